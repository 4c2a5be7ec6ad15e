"""The per-image decode loop: prefill the T2I prompt, then sample the visual-token grid under its contract.

Each generated token's hidden state appears when it is fed back in, so a row's hidden states are complete
right after its EOL is fed: that is when `on_row` streams the row. The final (look-ahead) token is never fed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ar_service.model.configuration import ARConfig
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.model.static_decode import StaticDecoder
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.prompt import Grid, allowed_token_range, build_t2i_prompt, system_prefix
from ar_service.sampling import RowSampling, SamplingParams, sample_rows

RowCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class GenerationCancelled(Exception):
    """Raised inside the decode loop when `should_stop()` says the request is gone."""


class ConditionLengthError(RuntimeError):
    """The generated positions carrying generation-vocabulary ids are not ``ar_h * (ar_w + 1)``: the DiT would get
    a condition of the wrong shape, so the request fails (the engine answers INTERNAL with this message)."""


@dataclass
class GridResult:
    token_ids: list[int]  # all grid.decode_tokens ids, look-ahead included
    text_condition: torch.Tensor  # [Lt, H]
    image_condition: torch.Tensor  # [grid.condition_positions, H]
    prefill_ms: float
    decode_ms: float


def prompt_ids_for(tokenizer, prompt: str, grid: Grid) -> list[int]:
    return list(tokenizer(build_t2i_prompt(prompt, grid), add_special_tokens=False)["input_ids"])


def text_condition_mask(prompt_ids: list[int], config: ARConfig) -> torch.Tensor:
    """Prompt positions that condition the DiT: no vision placeholders, nothing from the gen vocab.

    vllm-omni ``stage_input_processors/mammoth_moda2.py`` (``ar2dit``): ``questions_mask & ~(visual_token_mask |
    gen_token_mask)`` with visual ids <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
    (151655/151656/151652/151653 in Preview, read from llm_config) and gen ids ``>= gen_vocab_start_index``.
    """
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    mask = ids < config.gen_vocab_start_index
    for token in config.vision_placeholder_ids:
        mask &= ids != token
    return mask


def image_condition_mask(generated_ids: list[int], config: ARConfig) -> torch.Tensor:
    """Generated positions that condition the DiT: ids in the generation vocabulary (visual tokens and EOLs),
    the final look-ahead token dropped (it is never fed, so it has no hidden state; vllm-omni ``ar2dit``:
    ``cumulative_token_ids[:-1]``, then ``answers_mask & gen_token_mask``)."""
    ids = torch.tensor(generated_ids[:-1], dtype=torch.long)
    return ids >= config.gen_vocab_start_index


def check_image_condition(generated_ids: list[int], config: ARConfig, grid: Grid) -> None:
    """The image condition must be exactly ``ar_h * (ar_w + 1)`` rows; anything else fails the request."""
    count = int(image_condition_mask(generated_ids, config).sum())
    if count != grid.condition_positions:
        raise ConditionLengthError(
            f"image condition has {count} positions; a {grid.width}x{grid.height} grid needs "
            f"{grid.height} * ({grid.width} + 1) = {grid.condition_positions}"
        )


#: Rows every batched decode forward is padded to unless told otherwise (the engine's default max batch size).
DEFAULT_PAD_TO = 8


@dataclass
class PrefixCache:
    """The shared system-prompt prefix, prefilled once: its K/V and its condition states (all positions)."""

    ids: list[int]
    cache: KVCache
    condition: torch.Tensor  # [len(ids), H] on the model's device


def system_prefix_ids(tokenizer) -> list[int]:
    """The tokens every T2I prompt starts with (the envelope up to the user text)."""
    return list(tokenizer(system_prefix(), add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def build_prefix_cache(model: MammothModa2AR, prefix_ids: list[int]) -> PrefixCache:
    cache = KVCache(capacity=len(prefix_ids))
    condition = _forward_chunk(model, prefix_ids, 0, cache)[1]
    return PrefixCache(list(prefix_ids), cache, condition)


def _forward_chunk(model: MammothModa2AR, ids: list[int], past: int, cache: KVCache | None):
    device = model.device
    tensor = torch.tensor([ids], dtype=torch.long, device=device)
    positions = torch.arange(past, past + len(ids), device=device).unsqueeze(0)
    logits, hidden = model(tensor, positions, cache, num_logits=1)
    return logits[:, -1], hidden[0]


def _prefill(
    model: MammothModa2AR,
    prompt_ids: list[int],
    cache: KVCache | None,
    prefix_ids: list[int] | None = None,
    prefix: PrefixCache | None = None,
):
    """Prefill ``prompt_ids``; returns (last logits [1, V], text condition on the CPU, the cache used).

    When the prompt starts with the system prefix, the prefix and the rest run as two chunks: the prefix
    chunk is either computed here or, with ``prefix`` given, its K/V and states copied from the shared
    cache. Both ways run the same operations on the same shapes, so the result is the same to the bit.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if prefix is not None:
        prefix_ids = prefix.ids
    split = len(prefix_ids) if prefix_ids and len(prompt_ids) > len(prefix_ids) and prompt_ids[: len(prefix_ids)] == prefix_ids else 0
    if not split:
        logits, hidden = _forward_chunk(model, prompt_ids, 0, cache)
    else:
        if cache is None:
            cache = KVCache(capacity=len(prompt_ids))
        if prefix is not None:
            cache = prefix.cache.copy(capacity=cache.capacity)
            head = prefix.condition
        else:
            head = _forward_chunk(model, prompt_ids[:split], 0, cache)[1]
        logits, tail = _forward_chunk(model, prompt_ids[split:], split, cache)
        hidden = torch.cat([head, tail], dim=0)
    mask = text_condition_mask(prompt_ids, model.config).to(hidden.device)
    return logits, hidden[mask].cpu(), cache


@torch.inference_mode()
def text_condition_for(
    model: MammothModa2AR,
    prompt_ids: list[int],
    config: ARConfig | None = None,
    prefix_ids: list[int] | None = None,
    prefix: PrefixCache | None = None,
) -> tuple[torch.Tensor, float]:
    """Prefill only (e.g. a negative prompt); `config` is accepted for callers that pass it, and unused."""
    start = time.perf_counter()
    _, text, _ = _prefill(model, prompt_ids, None, prefix_ids, prefix)
    return text, (time.perf_counter() - start) * 1000


class DecodeStream:
    """One image being decoded: its cache (or decoder slot), position, grid column, constraints and seed.

    The token to append next is always drawn already: the first from the prefill's logits, each later one by
    the decode forward that fed its predecessor (``sample_rows`` with this stream's ``draw`` inputs). ``sample()``
    appends it; unless that was the look-ahead token, the stream then needs one forward (a decoder's ``step``
    batches those of many streams), whose hidden state and drawn token it takes in ``accept()``.
    Rows go to ``on_row(row, hidden [W+1, H] on the CPU, token ids)`` as soon as their EOL is fed.
    """

    def __init__(
        self,
        model: MammothModa2AR,
        prompt_ids: list[int],
        grid: Grid,
        t2i: T2IGenerationConfig,
        sampling: SamplingParams,
        seed: int,
        on_row: RowCallback | None = None,
        prefix_ids: list[int] | None = None,
        prefix: PrefixCache | None = None,
        reserve: bool = True,
    ) -> None:
        """``reserve``: size the prefill cache for the whole grid (the eager decoder grows it in place);
        a slot decoder copies the prompt's K/V into its own cache, so it needs only the prompt."""
        total = len(prompt_ids) + grid.decode_tokens
        if total > model.config.max_position_embeddings:
            raise ValueError(
                f"prompt + grid needs {total} positions; the model allows {model.config.max_position_embeddings}"
            )
        self.model, self.grid, self.t2i, self.sampling, self.on_row = model, grid, t2i, sampling, on_row
        self.seed = seed
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = []
        start = time.perf_counter()
        logits, self.text_condition, self.cache = _prefill(
            model, prompt_ids, KVCache(capacity=total if reserve else len(prompt_ids)), prefix_ids, prefix
        )  # .cpu() inside syncs the device
        lo, hi = allowed_token_range(0, grid, t2i)
        first = sample_rows(logits[:, lo : hi + 1], lo, RowSampling.build([self.draw], logits.device))
        self.next_token: int | None = int(first[0])
        self.prefill_ms = (time.perf_counter() - start) * 1000
        self.slot: int | None = None  # a slot decoder's row, while the stream holds one
        self.row_len = grid.width + 1
        self._row = torch.empty(self.row_len, model.config.hidden_size, dtype=model.dtype, device=model.device)

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.grid.decode_tokens

    @property
    def draw(self) -> tuple[tuple[int, int], SamplingParams, int, int]:
        """(allowed id range, sampling params, seed, step) of the token drawn next: ``sample_rows``' row inputs."""
        return self.draw_at(len(self.tokens))

    def draw_at(self, step: int) -> tuple[tuple[int, int], SamplingParams, int, int]:
        return allowed_token_range(step, self.grid, self.t2i), self.sampling, self.seed, step

    def sample(self) -> bool:
        """Appends the drawn token; True when it must be fed (a forward is due), False after the look-ahead."""
        if self.next_token is None:
            raise RuntimeError("no token drawn: accept() the last forward first")
        self.tokens.append(self.next_token)
        self.next_token = None
        if self.done:
            check_image_condition(self.tokens, self.model.config, self.grid)
            self.cache = None  # free the K/V now
            return False
        return True

    @property
    def feed(self) -> tuple[int, int]:
        """(token id, position) of the forward this stream waits for."""
        return self.tokens[-1], self.prompt_len + len(self.tokens) - 1

    def accept(self, hidden: torch.Tensor, next_token: int) -> None:
        """Takes this stream's row of a decode forward: the fed token's hidden state [H] and the token it drew."""
        self.next_token = next_token
        i = len(self.tokens) - 1
        self._row[i % self.row_len] = hidden
        if (i + 1) % self.row_len == 0:
            row = i // self.row_len
            ids = self.tokens[-self.row_len :]
            if min(ids) < self.model.config.gen_vocab_start_index:  # never with the grid sampler
                raise ConditionLengthError(f"grid row {row} holds ids outside the generation vocabulary")
            if self.on_row is not None:
                self.on_row(row, self._row.to("cpu", copy=True), torch.tensor(ids))


class EagerDecoder:
    """Each stream keeps its own growing KVCache; every step is one forward padded to ``pad_to`` rows (the
    CPU path: batch-invariant to the bit, see ``MammothModa2AR.decode``), then the row-wise sampler."""

    reserve = True

    def __init__(self, model: MammothModa2AR, pad_to: int = DEFAULT_PAD_TO) -> None:
        self.model, self.pad_to = model, pad_to

    def admit(self, stream: DecodeStream) -> None:
        """Nothing to do: the stream decodes in its own cache."""

    def release(self, stream: DecodeStream) -> None:
        stream.cache = None

    @torch.inference_mode()
    def step(self, streams: list[DecodeStream]) -> tuple[list[int], torch.Tensor]:
        """One forward for ``streams``: (the token each drew, hidden states [B, H])."""
        ids, positions = zip(*(s.feed for s in streams), strict=True)
        logits, hidden = self.model.decode(list(ids), list(positions), [s.cache for s in streams], pad_to=self.pad_to)
        rows = RowSampling.build([s.draw for s in streams], logits.device)
        return sample_rows(logits, self.model.config.gen_vocab_start_index, rows).tolist(), hidden


class SlotDecoder:
    """Streams decode in the fixed slots of a ``StaticDecoder`` (CUDA graphs, sampling inside): a stream takes a
    slot after its prefill and must give it back (``release``) when it finishes, fails or is cancelled."""

    reserve = False

    def __init__(self, static: StaticDecoder) -> None:
        self.static = static

    def admit(self, stream: DecodeStream) -> None:
        stream.slot = self.static.admit(stream.cache)
        stream.cache = None

    def release(self, stream: DecodeStream) -> None:
        stream.cache = None
        if stream.slot is not None:
            self.static.release(stream.slot)
            stream.slot = None

    @torch.inference_mode()
    def step(self, streams: list[DecodeStream]) -> tuple[list[int], torch.Tensor]:
        ids, positions = zip(*(s.feed for s in streams), strict=True)
        slots = [self._slot(s) for s in streams]
        tokens, hidden = self.static.step(slots, list(ids), list(positions), [s.draw for s in streams])
        if self.static.lookahead:
            # The likeliest next step: every stream that goes on feeds the token it just drew, one position on.
            going = [(s, token) for s, token in zip(streams, tokens, strict=True) if len(s.tokens) + 1 < s.grid.decode_tokens]
            if going:
                self.static.launch_ahead(
                    [self._slot(s) for s, _ in going],
                    [token for _, token in going],
                    [s.feed[1] + 1 for s, _ in going],
                    [s.draw_at(len(s.tokens) + 1) for s, _ in going],
                )
        return tokens, hidden

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
            tokens, hidden = decoder.step(feed)
            for b, stream in enumerate(feed):
                stream.accept(hidden[b], tokens[b])
        steps += 1
    for stream in running if release_unfinished else []:
        decoder.release(stream)
    return steps


@torch.inference_mode()
def generate_grid(
    model: MammothModa2AR,
    prompt_ids: list[int],
    grid: Grid,
    t2i: T2IGenerationConfig,
    sampling: SamplingParams,
    seed: int,
    on_row: RowCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_prefill: Callable[[torch.Tensor], None] | None = None,
    pad_to: int = DEFAULT_PAD_TO,
    prefix_ids: list[int] | None = None,
    prefix: PrefixCache | None = None,
    decoder: EagerDecoder | SlotDecoder | None = None,
) -> GridResult:
    """Decode exactly grid.decode_tokens tokens of one image alone (the engine's batched loop, batch of one);
    `on_prefill(text_condition)` fires before decoding. ``decoder`` defaults to an ``EagerDecoder(pad_to)``."""
    decoder = decoder or EagerDecoder(model, pad_to)
    rows: list[torch.Tensor] = []

    def keep_row(row: int, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        rows.append(hidden)
        if on_row is not None:
            on_row(row, hidden, ids)

    stream = DecodeStream(model, prompt_ids, grid, t2i, sampling, seed, keep_row, prefix_ids, prefix, decoder.reserve)
    if on_prefill is not None:
        on_prefill(stream.text_condition)
    decoder.admit(stream)
    start = time.perf_counter()
    try:
        for i in range(grid.decode_tokens):
            if should_stop is not None and should_stop():
                raise GenerationCancelled(f"stopped after {i} of {grid.decode_tokens} tokens")
            if not stream.sample():
                break
            tokens, hidden = decoder.step([stream])
            stream.accept(hidden[0], tokens[0])
    finally:
        decoder.release(stream)
    decode_ms = (time.perf_counter() - start) * 1000
    image = torch.cat(rows, dim=0) if rows else torch.empty(0, model.config.hidden_size, dtype=model.dtype)
    return GridResult(stream.tokens, stream.text_condition, image, stream.prefill_ms, decode_ms)
