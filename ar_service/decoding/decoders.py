"""The decoders a scheduler steps: each takes the decode streams of one step and runs their lanes in one batched
forward. ``EagerDecoder``: each stream its own growing cache, any decoding mode. ``SlotDecoder``: fixed slots of a
``StaticDecoder`` (CUDA graphs on CUDA). ``decode_together`` is the engine's token loop without the engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ar_service.decoding.modes import SEQUENTIAL, SPECULATIVE, Decoding, Forwarded, Lane
from ar_service.decoding.stream import DecodeStream
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.model.static_decode import StaticDecoder
from ar_service.sampling import Draw, RowSampling, guided, sample_rows

#: Rows every batched decode forward is padded to unless told otherwise (the engine's default max batch size).
DEFAULT_PAD_TO = 8
#: Decode rows one image may take: its own and, with AR guidance, its unconditional row.
ROWS_PER_IMAGE = 2


def _step_rows(streams: list[DecodeStream], feeds: list[tuple[int, int]], steps: list[int],
               uncond_places: list[int | None]) -> tuple[list[int], list[int], list[Draw]]:
    """The decode rows of one step: each stream's row (fed ``feeds[b]``, drawing token ``steps[b]``), then the
    unconditional row of each guided stream, fed the same token ``uncond_offset`` positions back. ``uncond_places``:
    the index each unconditional row takes in the step (its list position, or its decoder slot), which the guided
    row's draw names. Returns (ids, positions, draws) in that order."""
    ids = [token for token, _ in feeds]
    positions = [position for _, position in feeds]
    draws = [s.draw_at(step) for s, step in zip(streams, steps, strict=True)]
    for b, s in enumerate(streams):
        if s.uncond is not None:
            ids.append(ids[b])
            positions.append(positions[b] - s.uncond_offset)
            draws.append(draws[b])  # drawn too, and thrown away: the unconditional row feeds its image's token
            place = uncond_places[b]
            assert place is not None, "a guided stream's unconditional row has a place in the step"
            draws[b] = guided(draws[b], s.guidance, place)
    return ids, positions, draws


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
        tokens = sample_rows(every, self.model.config.gen_vocab_start_index, rows).tolist()
        return [Forwarded(lanes, states[first : first + len(lanes)], tokens[first : first + len(lanes)])
                for first, lanes in shares]


class SlotDecoder:
    """Streams decode in the fixed slots of a ``StaticDecoder`` (CUDA graphs, sampling inside): a stream takes a
    slot after its prefill (two when guided: its unconditional row takes another) and must give them back
    (``release``) when it finishes, fails or is cancelled. A step of streams that feed one token each puts each
    row at its slot (``StaticDecoder.step``); when a stream feeds several (speculative decoding, which needs a
    ``StaticDecoder`` built with ``shared_slots``), the rows go in order through ``step_lanes``, as many as the
    decoder has rows: each stream feeds at least its first lane, the rest share what is left. Row-parallel decoding
    (cache order unlike position order) runs on the ``EagerDecoder`` only."""

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
    def _rows(streams: list[DecodeStream], feeds: list[tuple[int, int]], steps: list[int]):
        """(slots, ids, positions, draws) of a static step: the streams' slots, then their unconditional rows'."""
        uncond = [None if s.uncond is None else s.uncond.slot for s in streams]
        ids, positions, draws = _step_rows(streams, feeds, steps, uncond)
        slots = [s.slot for s in streams] + [slot for slot in uncond if slot is not None]
        return slots, ids, positions, draws

    def decodes(self, decoding: Decoding) -> bool:
        """Whether streams of ``decoding`` can run here."""
        return decoding.mode == SEQUENTIAL or (decoding.mode == SPECULATIVE and self.static.shared_slots)

    def _fit(self, streams: list[DecodeStream], lanes: list[list[Lane]]) -> list[list[Lane]]:
        """Each stream's lanes cut to what the decoder's rows hold: the first lane of every stream, then one more
        lane per stream in turn while rows are left (a guided lane takes two rows)."""
        width = [2 if s.uncond is not None else 1 for s in streams]
        left = self.static.slots - sum(width)
        if left < 0:
            raise RuntimeError("more streams than the decoder has rows")
        kept = [1] * len(streams)
        growing = True
        while growing:
            growing = False
            for b in range(len(streams)):
                if kept[b] < len(lanes[b]) and width[b] <= left:
                    kept[b] += 1
                    left -= width[b]
                    growing = True
        return [lane[:k] for lane, k in zip(lanes, kept, strict=True)]

    def _step_lanes(self, streams: list[DecodeStream], lanes: list[list[Lane]]) -> list[Forwarded]:
        slots: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        draws: list[Draw] = []
        shares: list[tuple[int, list[Lane]]] = []
        for s, fed in zip(streams, lanes, strict=True):
            first = len(ids)
            shares.append((first, fed))
            for lane in fed:
                slots.append(self._slot(s))
                ids.append(lane.token)
                positions.append(lane.position)
                draws.append(s.draw_at(lane.step))
            if s.uncond is not None:
                assert s.uncond.slot is not None, "a guided stream's unconditional row holds a slot"
                offset = s.uncond_offset
                for j, lane in enumerate(fed):
                    slots.append(s.uncond.slot)
                    ids.append(lane.token)
                    positions.append(lane.position - offset)
                    draws.append(draws[first + j])
                    draws[first + j] = guided(draws[first + j], s.guidance, len(ids) - 1)
        tokens, hidden = self.static.step_lanes(slots, ids, positions, draws)
        return [Forwarded(fed, hidden[first : first + len(fed)], tokens[first : first + len(fed)])
                for first, fed in shares]

    @torch.inference_mode()
    def step(self, streams: list[DecodeStream]) -> list[Forwarded]:
        n = len(streams)
        lanes = [s.lanes() for s in streams]
        if any(len(fed) > 1 for fed in lanes):
            return self._step_lanes(streams, self._fit(streams, lanes))
        tokens, hidden = self.static.step(*self._rows(streams, [s.feed for s in streams], [len(s.tokens) for s in streams]))
        tokens, hidden = tokens[:n], hidden[:n]
        if self.static.lookahead:
            # The likeliest next step: every stream that goes on feeds the token it just drew, one position on.
            going = [(s, token) for s, token in zip(streams, tokens, strict=True) if s.feeds(len(s.tokens))]
            if going:
                self.static.launch_ahead(*self._rows(
                    [s for s, _ in going],
                    [(token, s.feed[1] + 1) for s, token in going],
                    [len(s.tokens) + 1 for s, _ in going],
                ))
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

