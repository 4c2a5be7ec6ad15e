"""The decoders a scheduler steps: each takes the decode streams of one step and runs their lanes in one batched
forward. ``EagerDecoder``: each stream its own growing cache, any decoding mode. ``SlotDecoder``: fixed slots of a
``StaticDecoder`` (CUDA graphs on CUDA). ``decode_together`` is the engine's token loop without the engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ar_service.decoding.modes import ROW_PARALLEL, SEQUENTIAL, Decoding, Forwarded, Lane
from ar_service.decoding.stream import DecodeStream
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.model.static_decode import StaticDecoder
from ar_service.sampling import Draw, RowSampling, guided, sample_rows

#: Rows every batched decode forward is padded to unless told otherwise (the engine's default max batch size).
DEFAULT_PAD_TO = 8
#: Decode rows one image may take: its own and, with AR guidance, its unconditional row.
ROWS_PER_IMAGE = 2


class EagerDecoder:
    """Each stream keeps its own growing KVCache; a step feeds every stream's lanes (``DecodeStream.lanes``: one
    token, or several under a parallel decoding mode), each lane writing its K/V at its own cache index. The rows
    run as forwards of ``pad_to`` rows each (the CPU path: batch-invariant to the bit, see ``MammothModa2AR.decode``;
    a stream's lanes keep their order across the forwards, so a lane sees those before it), then the row-wise
    sampler over all of them. A guided stream's unconditional row feeds the same lanes in its own cache."""

    reserve = True

    def __init__(self, model: MammothModa2AR, pad_to: int = DEFAULT_PAD_TO) -> None:
        self.model, self.pad_to = model, pad_to

    def decodes(self, decoding: Decoding) -> bool:
        """Every mode runs here: each stream has a cache of its own and feeds any number of lanes."""
        return True

    def admit(self, stream: DecodeStream) -> None:
        """Nothing to do: the stream decodes in its own cache."""

    def release(self, stream: DecodeStream) -> None:
        stream.cache = None
        if stream.uncond is not None:
            stream.uncond.cache = None

    @torch.inference_mode()
    def step(self, streams: list[DecodeStream]) -> list[Forwarded]:
        """One decode step for ``streams``: what each stream's lanes gave (``DecodeStream.advance`` takes it)."""
        ids: list[int] = []
        positions: list[int] = []
        indexes: list[int] = []
        caches: list[KVCache] = []
        draws: list[Draw] = []
        shares: list[tuple[int, list[Lane]]] = []  # (first row, lanes) of each stream

        def add(token: int, position: int, index: int, cache: KVCache | None, draw: Draw) -> None:
            assert cache is not None, "a stream decodes with its cache until it is released"
            ids.append(token)
            positions.append(position)
            indexes.append(index)
            caches.append(cache)
            draws.append(draw)

        for s in streams:
            lanes = s.lanes()
            if not lanes:
                raise RuntimeError("a stream that goes on must feed at least one token")
            first = len(ids)
            shares.append((first, lanes))
            for lane in lanes:
                add(lane.token, lane.position, lane.cache_index, s.cache, s.draw_at(lane.step))
            if s.uncond is not None:
                offset = s.uncond_offset
                for j, lane in enumerate(lanes):
                    add(lane.token, lane.position - offset, lane.cache_index - offset, s.uncond.cache, draws[first + j])
                    # drawn too, and thrown away: the unconditional row feeds its image's token
                    draws[first + j] = guided(draws[first + j], s.guidance, len(ids) - 1)
        logits, hidden = [], []
        for start in range(0, len(ids), self.pad_to):
            end = start + self.pad_to
            part = self.model.decode(ids[start:end], positions[start:end], caches[start:end], pad_to=self.pad_to,
                                     indexes=indexes[start:end])
            logits.append(part[0])
            hidden.append(part[1])
        every = torch.cat(logits) if len(logits) > 1 else logits[0]
        states = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        rows = RowSampling.build(draws, every.device)
        tokens = sample_rows(every, self.model.config.gen_logit_start, rows).tolist()
        return [Forwarded(lanes, states[first : first + len(lanes)], tokens[first : first + len(lanes)])
                for first, lanes in shares]


class SlotDecoder:
    """Streams decode in the fixed slots of a ``StaticDecoder`` (CUDA graphs, sampling inside): a stream takes a
    slot after its prefill (two when guided: its unconditional row takes another) and must give them back
    (``release``) when it finishes, fails or is cancelled. A step of streams that feed one token each puts each
    row at its slot (``StaticDecoder.step``); when a stream feeds several (speculative and row-parallel decoding,
    which need a ``StaticDecoder`` built with ``shared_slots``), the rows go in order through ``step_lanes``, in
    passes of at most the decoder's ``lane_rows`` (``_passes``). Each row is rotated at its lane's position and
    writes its K/V at its lane's cache index, which row-parallel decoding takes in generation order."""

    reserve = False

    def __init__(self, static: StaticDecoder) -> None:
        self.static = static

    def admit(self, stream: DecodeStream) -> None:
        if not self.decodes(stream.decoding):
            raise ValueError(f"this slot decoder cannot decode ar_decoding {stream.decoding.mode}")
        stream.slot = self.static.admit(stream.cache)
        stream.cache = None
        if stream.uncond is not None:
            assert stream.uncond.cache is not None, "a stream is admitted once, after its prefill"
            try:
                stream.uncond.slot = self.static.admit(stream.uncond.cache)
            except Exception:
                self.release(stream)
                raise
            stream.uncond.cache = None

    def release(self, stream: DecodeStream) -> None:
        stream.cache = None
        for holder in (stream, stream.uncond):
            if holder is not None and holder.slot is not None:
                self.static.release(holder.slot)
                holder.slot = None
        if stream.uncond is not None:
            stream.uncond.cache = None

    @staticmethod
    def _rows(streams: list[DecodeStream], lanes: list[Lane]):
        """(slots, ids, positions, draws, cache indexes) of a static step where each stream feeds one lane: the
        streams' rows at their slots, then the unconditional row of each guided stream, fed the same token
        ``uncond_offset`` positions back; a guided row's draw names its unconditional row's slot."""
        slots = [SlotDecoder._slot(s) for s in streams]
        ids = [lane.token for lane in lanes]
        positions = [lane.position for lane in lanes]
        indexes = [lane.cache_index for lane in lanes]
        draws = [s.draw_at(lane.step) for s, lane in zip(streams, lanes, strict=True)]
        for b, s in enumerate(streams):
            if s.uncond is not None:
                assert s.uncond.slot is not None, "a guided stream's unconditional row holds a slot"
                slots.append(s.uncond.slot)
                ids.append(ids[b])
                positions.append(positions[b] - s.uncond_offset)
                indexes.append(indexes[b] - s.uncond_offset)
                draws.append(draws[b])  # drawn too, and thrown away: the unconditional row feeds its image's token
                draws[b] = guided(draws[b], s.guidance, s.uncond.slot)
        return slots, ids, positions, draws, indexes

    def decodes(self, decoding: Decoding) -> bool:
        """Whether streams of ``decoding`` can run here: one token per forward always; several (speculative and
        row-parallel lanes) when rows of one slot may share a step."""
        return decoding.mode == SEQUENTIAL or self.static.shared_slots

    def _passes(self, streams: list[DecodeStream], lanes: list[list[Lane]]) -> list[list[tuple[int, Lane]]]:
        """The lanes a step feeds, as (stream, lane) in passes of at most the decoder's ``lane_rows`` (a guided lane
        takes two rows, its unconditional one in the same pass). Every lane of a row-parallel stream goes, in as many
        passes as they need: which tokens a row-parallel lane sees is its grid, so it must not depend on the
        batch-mates (a later pass sees the K/V an earlier one wrote, as a lane sees the lanes before it in one pass).
        Of any other stream the first lane goes; the other lanes of speculative streams then fill what the last pass
        has left, one more per stream in turn (drafts: fewer of them means more forwards, never another grid)."""
        width = [2 if s.uncond is not None else 1 for s in streams]
        room = self.static.lane_rows
        if max(width) > room:
            raise RuntimeError("a guided stream needs two rows; the decoder has one")
        passes: list[list[tuple[int, Lane]]] = [[]]
        used = [0]
        kept = []
        for b, s in enumerate(streams):
            required = lanes[b] if s.decoding.mode == ROW_PARALLEL else lanes[b][:1]
            for lane in required:
                if used[-1] + width[b] > room:
                    passes.append([])
                    used.append(0)
                passes[-1].append((b, lane))
                used[-1] += width[b]
            kept.append(len(required))
        growing = True
        while growing:
            growing = False
            for b in range(len(streams)):
                if kept[b] < len(lanes[b]) and used[-1] + width[b] <= room:
                    passes[-1].append((b, lanes[b][kept[b]]))
                    used[-1] += width[b]
                    kept[b] += 1
                    growing = True
        return passes

    def _step_lanes(self, streams: list[DecodeStream], lanes: list[list[Lane]]) -> list[Forwarded]:
        fed: list[list[Lane]] = [[] for _ in streams]
        hidden: list[list[torch.Tensor]] = [[] for _ in streams]
        drawn: list[list[int]] = [[] for _ in streams]
        for part in self._passes(streams, lanes):
            slots: list[int] = []
            ids: list[int] = []
            positions: list[int] = []
            indexes: list[int] = []
            draws: list[Draw] = []
            for b, lane in part:
                slots.append(self._slot(streams[b]))
                ids.append(lane.token)
                positions.append(lane.position)
                indexes.append(lane.cache_index)
                draws.append(streams[b].draw_at(lane.step))
            for row, (b, lane) in enumerate(part):
                s = streams[b]
                if s.uncond is not None:
                    assert s.uncond.slot is not None, "a guided stream's unconditional row holds a slot"
                    slots.append(s.uncond.slot)
                    ids.append(lane.token)
                    positions.append(lane.position - s.uncond_offset)
                    indexes.append(lane.cache_index - s.uncond_offset)
                    draws.append(draws[row])  # drawn too, and thrown away: the unconditional row feeds its token
                    draws[row] = guided(draws[row], s.guidance, len(ids) - 1)
            tokens, states = self.static.step_lanes(slots, ids, positions, draws, indexes)
            for row, (b, lane) in enumerate(part):
                fed[b].append(lane)
                hidden[b].append(states[row : row + 1])
                drawn[b].append(tokens[row])
        return [Forwarded(fed[b], torch.cat(hidden[b]), drawn[b]) for b in range(len(streams))]

    @torch.inference_mode()
    def step(self, streams: list[DecodeStream]) -> list[Forwarded]:
        n = len(streams)
        lanes = [s.lanes() for s in streams]
        if any(len(fed) > 1 for fed in lanes):
            return self._step_lanes(streams, lanes)
        fed = [lane for lane, in lanes]
        tokens, hidden = self.static.step(*self._rows(streams, fed))
        tokens, hidden = tokens[:n], hidden[:n]
        if self.static.lookahead:
            # The likeliest next step: every stream that goes on feeds the token it just drew, one position on. Not
            # for row-parallel streams: their next lane may be another row's, and a step launched ahead writes K/V at
            # the cache index it guessed, which such a stream may already hold.
            going = [(s, Lane(token, lane.position + 1, lane.cache_index + 1, lane.step + 1))
                     for s, lane, token in zip(streams, fed, tokens, strict=True)
                     if s.decoding.mode != ROW_PARALLEL and s.feeds(lane.step)]
            if going:
                self.static.launch_ahead(*self._rows([s for s, _ in going], [lane for _, lane in going]))
        return [Forwarded(lane, hidden[b : b + 1], [tokens[b]]) for b, lane in enumerate(lanes)]

    @staticmethod
    def _slot(stream: DecodeStream) -> int:
        assert stream.slot is not None, "a stream steps only while admitted to a slot"
        return stream.slot


def decode_together(
    decoder: EagerDecoder | SlotDecoder,
    streams: list[DecodeStream],
    joiners: Sequence[DecodeStream] = (),
    join_every: int = 1,
    max_steps: int | None = None,
    release_unfinished: bool = True,
) -> int:
    """The engine's token loop without the engine (benchmarks, tests): decodes ``streams`` together, the last of
    ``joiners`` joining every ``join_every`` steps, until all are done or ``max_steps`` ran; returns the steps run.
    Finished streams give their decoder slot back, unfinished ones too unless ``release_unfinished`` is False."""
    running, waiting, steps = list(streams), list(joiners), 0
    while (running or waiting) and (max_steps is None or steps < max_steps):
        if steps % join_every == 0 and waiting:
            running.append(waiting.pop())
        feed = []
        for stream in running:
            if stream.sample():
                feed.append(stream)
            else:
                decoder.release(stream)
        running = feed
        if feed:
            for stream, share in zip(feed, decoder.step(feed), strict=True):
                stream.advance(share)
        steps += 1
    for stream in running if release_unfinished else []:
        decoder.release(stream)
    return steps

