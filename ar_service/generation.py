"""The per-image decode loop: prefill the T2I prompt, then sample the visual-token grid under its contract.

Each generated token's hidden state appears when it is fed back in, so a row's hidden states are complete
right after its EOL is fed: that is when `on_row` streams the row. The final (look-ahead) token is never fed,
except under the released Preview condition scope (``ANSWER_WINDOW``), where it is ``<|image end|>`` and is fed
for its hidden state.

AR classifier-free guidance (released MammothModa2 ``mammothmoda2/model/modeling_mammothmoda2.py``
``generate_t2i``, qwen25vl branch, lines 254-262 and 305-306): a guided image decodes a second, unconditional row
that sees only the last ``UNCOND_PROMPT_TOKENS`` prompt tokens; every draw mixes the two rows' logits
(``ar_service.sampling.mix_guidance``) and both rows are then fed the token drawn.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from ar_service.decoding import SEQUENTIAL, SPECULATIVE, Decoding, Forwarded, Lane
from ar_service.model.configuration import ARConfig
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.model.static_decode import StaticDecoder
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tokenizer import IMAGE_END_TOKEN
from ar_service.prompt import Grid, allowed_token_range, build_negative_prompt, build_t2i_prompt, system_prefix
from ar_service.sampling import Draw, RowSampling, SamplingParams, guided, sample_rows

T = TypeVar("T")
RowCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
WindowCallback = Callable[[torch.Tensor], None]

#: Prompt tokens the unconditional row of AR guidance sees. The released ``generate_t2i`` doubles the batch and sets
#: ``attention_mask[unguided_bsz:, :-10] = 0``; Qwen2.5-VL then numbers that row's positions by the mask's running
#: sum (``get_rope_index``: ``attention_mask.cumsum(-1) - 1``, ``rope_deltas`` carried into decode), so the row is
#: exactly the last 10 prompt tokens at positions 0..9 followed by the generated tokens at 10, 11, ... For the
#: usual grids these 10 tokens are ``<|im_start|>assistant\n<|image start|>{w}*{h}<|image token|>``.
UNCOND_PROMPT_TOKENS = 10

#: Which generated positions become the DiT's image condition (``ServingDefaults.condition_scope``).
#: ``all_generated``: every grid position (visual tokens and EOLs), the look-ahead token dropped (vllm-omni
#: ``ar2dit``; bytedance/mammothmoda main branch for the Dev model). ``answer_window``: the released Preview code
#: (qwen25vl ``mammothmoda2/utils/t2i_utils.py`` lines 293-305): the sequence prompt + grid + ``<|image end|>``
#: is split at ``len - 10``; generation-vocabulary ids after the split are the image condition (about 10 rows),
#: and only positions before it may be text condition.
ALL_GENERATED = "all_generated"
ANSWER_WINDOW = "answer_window"
CONDITION_SCOPES = (ALL_GENERATED, ANSWER_WINDOW)
#: The released Preview answer window: the last 10 positions of prompt + grid + ``<|image end|>``.
ANSWER_WINDOW_POSITIONS = 10


class GenerationCancelled(Exception):
    """Raised inside the decode loop when `should_stop()` says the request is gone."""


class ConditionLengthError(RuntimeError):
    """The generated positions carrying generation-vocabulary ids are not ``ar_h * (ar_w + 1)``: the DiT would get
    a condition of the wrong shape, so the request fails (the engine answers INTERNAL with this message)."""


@dataclass(frozen=True)
class DecodeChoices:
    """What a checkpoint's serving settings (servicekit ``ServingDefaults``) choose where the released code and
    ardit's defaults differ: the visual range sampled, which rows become the image condition (and the
    ``<|image end|>`` id that ``answer_window`` feeds), the negative prompt used when a request has none."""

    t2i: T2IGenerationConfig
    condition_scope: str = ALL_GENERATED
    image_end_id: int | None = None
    default_negative_prompt: str = ""

    @classmethod
    def from_serving(cls, t2i: T2IGenerationConfig, config: ARConfig, tokenizer, serving) -> DecodeChoices:
        if serving.visual_token_scope == "start_plus_end":
            t2i = t2i.with_released_scope(config.total_vocab_size)
        image_end_id = None
        if serving.condition_scope != ALL_GENERATED:
            image_end_id = tokenizer.convert_tokens_to_ids(IMAGE_END_TOKEN)
            if image_end_id is None or image_end_id < config.gen_vocab_start_index:
                raise ValueError(f"condition_scope {serving.condition_scope} needs {IMAGE_END_TOKEN} in the tokenizer's "
                                 "generation vocabulary")
        return cls(t2i, serving.condition_scope, image_end_id, serving.default_negative_prompt)


@dataclass
class GridResult:
    token_ids: list[int]  # all grid.decode_tokens ids, look-ahead included
    text_condition: torch.Tensor  # [Lt, H]
    image_condition: torch.Tensor  # [grid.condition_positions, H]
    prefill_ms: float
    decode_ms: float
    forwards: int = 0  # decode forwards (steps) the grid took


def prompt_ids_for(tokenizer, prompt: str, grid: Grid) -> list[int]:
    return list(tokenizer(build_t2i_prompt(prompt, grid), add_special_tokens=False)["input_ids"])


def text_condition_mask(prompt_ids: list[int], config: ARConfig, question_end: int | None = None) -> torch.Tensor:
    """Prompt positions that condition the DiT: no vision placeholders, nothing from the gen vocab, and (when
    ``question_end`` is given, see ``question_end``) nothing from that position on.

    vllm-omni ``stage_input_processors/mammoth_moda2.py`` (``ar2dit``): ``questions_mask & ~(visual_token_mask |
    gen_token_mask)`` with visual ids <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
    (151655/151656/151652/151653 in Preview, read from llm_config) and gen ids ``>= gen_vocab_start_index``.
    """
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    mask = ids < config.gen_vocab_start_index
    for token in config.vision_placeholder_ids:
        mask &= ids != token
    if question_end is not None:
        mask[question_end:] = False
    return mask


def question_end(prompt_len: int, grid: Grid, scope: str) -> int | None:
    """Where the question (the positions that may be text condition) ends: nowhere inside the prompt for
    ``all_generated``; for ``answer_window`` at ``len(prompt + grid + <|image end|>) - 10``, which cuts into the
    prompt only for grids of fewer than 9 positions."""
    if scope == ALL_GENERATED:
        return None
    return min(prompt_len, prompt_len + grid.condition_positions + 1 - ANSWER_WINDOW_POSITIONS)


def image_condition_positions(prompt_ids: list[int], grid: Grid, scope: str, config: ARConfig) -> int:
    """Rows of the image condition an image of ``grid`` hands the DiT under ``scope`` (known before decoding: every
    grid position and ``<|image end|>`` are generation-vocabulary ids)."""
    if scope == ALL_GENERATED:
        return grid.condition_positions
    if scope != ANSWER_WINDOW:
        raise ValueError(f"condition scope must be one of {', '.join(CONDITION_SCOPES)}; got {scope!r}")
    generated = grid.condition_positions + 1  # the grid and <|image end|>
    from_prompt = max(0, ANSWER_WINDOW_POSITIONS - generated)
    prompt_tail = prompt_ids[len(prompt_ids) - from_prompt :] if from_prompt else []
    return min(generated, ANSWER_WINDOW_POSITIONS) + sum(t >= config.gen_vocab_start_index for t in prompt_tail)


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
#: Decode rows one image may take: its own and, with AR guidance, its unconditional row.
ROWS_PER_IMAGE = 2


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
    """Prefill ``prompt_ids``; returns (last logits [1, V], condition states of every position [L, H] on the
    model's device, the cache used).

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
    return logits, hidden, cache


def _text_condition(model: MammothModa2AR, prompt_ids: list[int], hidden: torch.Tensor, end: int | None = None):
    return hidden[text_condition_mask(prompt_ids, model.config, end).to(hidden.device)].cpu()


@torch.inference_mode()
def text_condition_for(
    model: MammothModa2AR,
    prompt_ids: list[int],
    config: ARConfig | None = None,
    prefix_ids: list[int] | None = None,
    prefix: PrefixCache | None = None,
) -> tuple[torch.Tensor, float]:
    """Prefill only: the prompt's text condition; `config` is accepted for callers that pass it, and unused."""
    start = time.perf_counter()
    _, hidden, _ = _prefill(model, prompt_ids, None, prefix_ids, prefix)
    return _text_condition(model, prompt_ids, hidden), (time.perf_counter() - start) * 1000


def negative_prompt_ids(tokenizer, negative_prompt: str) -> list[int]:
    return list(tokenizer(build_negative_prompt(negative_prompt), add_special_tokens=False)["input_ids"])


#: Repeated prefills ``PrefillMemo`` keeps by default (ar_service's ``prefill_memo``).
PREFILL_MEMO_ENTRIES = 16


class PrefillMemo:
    """Prefills that repeat across requests, kept by their token ids: a negative prompt's condition states (most
    requests use the model's default negative prompt) and an AR-guided image's unconditional row (the same
    ``UNCOND_PROMPT_TOKENS`` tokens for every image of one size).

    Why: each is one eager forward, bound by the host launching its kernels (25-35 ms for Preview on an H200 in bf16,
    55-70 ms in FP8: bench.prefill_parts), and the AR's decode batch waits while a newcomer prefills. An eager
    forward of the same ids computes the same bits, so a hit returns exactly what the prefill would have. At most
    ``entries`` are kept, the least recently used going first; what it returns is shared and must be read only.
    """

    def __init__(self, entries: int = PREFILL_MEMO_ENTRIES,
                 on_lookup: Callable[[str, bool], None] | None = None) -> None:
        """``on_lookup(kind, hit)``: told of every lookup (the service counts them in its metrics)."""
        if entries < 1:
            raise ValueError(f"entries must be >= 1; got {entries}")
        self.entries, self.on_lookup = entries, on_lookup
        self.hits = self.misses = 0
        self._kept: OrderedDict[Hashable, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, kind: str, ids: Sequence[int], compute: Callable[[], T]) -> T:
        """The value kept for (``kind``, ``ids``), else ``compute()``'s, then kept."""
        key = (kind, tuple(ids))
        hit = key in self._kept
        if self.on_lookup is not None:
            self.on_lookup(kind, hit)
        if hit:
            self._kept.move_to_end(key)
            self.hits += 1
            return cast(T, self._kept[key])
        self.misses += 1
        value = self._kept[key] = compute()
        while len(self._kept) > self.entries:
            self._kept.popitem(last=False)
        return value


@torch.inference_mode()
def negative_condition_for(
    model: MammothModa2AR,
    negative_ids: list[int],
    prefix_ids: list[int] | None = None,
    prefix: PrefixCache | None = None,
    memo: PrefillMemo | None = None,
) -> tuple[torch.Tensor, float]:
    """The unconditional branch of the DiT's guidance as released (qwen25vl ``t2i_utils.py`` ``encode_full_prompts``
    lines 141-147): the condition states of every position of the negative envelope (``build_negative_prompt``),
    none masked. Returns ([L, H] on the CPU, read only when ``memo`` keeps it; prefill ms)."""
    start = time.perf_counter()

    def prefill() -> torch.Tensor:
        return _prefill(model, negative_ids, None, prefix_ids, prefix)[1].cpu()

    condition = prefill() if memo is None else memo.get("negative", negative_ids, prefill)
    return condition, (time.perf_counter() - start) * 1000


class UnconditionalRow:
    """The second decode row of an AR-guided image: the last ``UNCOND_PROMPT_TOKENS`` prompt tokens as a sequence of
    their own (positions 0..9), then every token the image draws, one position further each (see the constant)."""

    def __init__(self, model: MammothModa2AR, prompt_ids: list[int], grid: Grid, reserve: bool,
                 memo: PrefillMemo | None = None) -> None:
        """``reserve``: as ``DecodeStream`` takes it. ``memo``: where a row of the same tokens may already be."""
        ids = prompt_ids[-UNCOND_PROMPT_TOKENS:]
        self.prompt_len = len(ids)

        def prefill() -> tuple[torch.Tensor, KVCache]:
            logits, _, cache = _prefill(model, ids, KVCache(capacity=len(ids)))
            return logits, cache

        self.logits, cache = prefill() if memo is None else memo.get("unconditional", ids, prefill)
        # The eager decoder grows this cache in place: its own copy, sized for the grid. A slot decoder only copies
        # it into a slot (SlotDecoder.admit), so a kept one is handed over as it is.
        self.cache: KVCache | None = cache.copy(capacity=len(ids) + grid.decode_tokens) if reserve else cache
        self.slot: int | None = None  # a slot decoder's row, while the image holds one


class DecodeStream:
    """One image being decoded: its cache (or decoder slot), position, grid column, constraints and seed, and
    with AR guidance its ``UnconditionalRow``.

    The token to append next is always drawn already: the first from the prefill's logits, each later one by
    the decode forward that fed its predecessor (``sample_rows`` with this stream's ``draw`` inputs). ``sample()``
    appends it; unless that was the look-ahead token, the stream then needs one forward (a decoder's ``step``
    batches those of many streams), whose hidden state and drawn token it takes in ``accept()``.
    Rows go to ``on_row(row, hidden [W+1, H] on the CPU, token ids)`` as soon as their EOL is fed. Under the
    ``answer_window`` scope the look-ahead token is ``<|image end|>`` and is fed too; then ``on_window(hidden)``
    gets the image condition ([n, H] on the CPU, n = ``image_condition_positions``).
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
        guidance: float = 1.0,
        condition_scope: str = ALL_GENERATED,
        image_end_id: int | None = None,
        on_window: WindowCallback | None = None,
        memo: PrefillMemo | None = None,
        decoding: Decoding | None = None,
    ) -> None:
        """``reserve``: size the prefill cache for the whole grid (the eager decoder grows it in place);
        a slot decoder copies the prompt's K/V into its own cache, so it needs only the prompt. ``guidance``: the
        AR guidance scale (<= 1: off). ``image_end_id``: ``<|image end|>``, needed by the ``answer_window`` scope.
        ``memo``: keeps the unconditional row's prefill for the next image of the same size. ``decoding``: how many
        tokens a forward may decide (``ar_service.decoding``; default sequential)."""
        total = len(prompt_ids) + grid.decode_tokens
        if total > model.config.max_position_embeddings:
            raise ValueError(
                f"prompt + grid needs {total} positions; the model allows {model.config.max_position_embeddings}"
            )
        if condition_scope not in CONDITION_SCOPES:
            raise ValueError(f"condition_scope must be one of {', '.join(CONDITION_SCOPES)}; got {condition_scope!r}")
        if condition_scope == ANSWER_WINDOW and image_end_id is None:
            raise ValueError("the answer_window condition scope needs the <|image end|> id")
        self.model, self.grid, self.t2i, self.sampling, self.on_row = model, grid, t2i, sampling, on_row
        self.seed, self.guidance = seed, float(guidance)
        self.feeds_last = condition_scope == ANSWER_WINDOW
        self.image_end_id, self.on_window = image_end_id, on_window
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = []
        self.image_condition: torch.Tensor | None = None  # the answer window, once complete
        self._complete = False
        start = time.perf_counter()
        logits, hidden, self.cache = _prefill(
            model, prompt_ids, KVCache(capacity=total if reserve else len(prompt_ids)), prefix_ids, prefix
        )
        self.text_condition = _text_condition(model, prompt_ids, hidden, question_end(len(prompt_ids), grid, condition_scope))
        # (id, condition state) of the last positions: the answer window's candidates, prompt positions first.
        self._recent: deque[tuple[int, torch.Tensor]] = deque(
            zip(prompt_ids[-ANSWER_WINDOW_POSITIONS:], hidden[-ANSWER_WINDOW_POSITIONS:], strict=True)
            if self.feeds_last else (), maxlen=ANSWER_WINDOW_POSITIONS,
        )
        self.uncond = UnconditionalRow(model, prompt_ids, grid, reserve, memo) if self.guidance > 1 else None
        lo, hi = self.draw[0]
        if self.uncond is None:
            first = sample_rows(logits[:, lo : hi + 1], lo, RowSampling.build([self.draw], logits.device))
        else:
            both = torch.cat([logits, self.uncond.logits])[:, lo : hi + 1]
            first = sample_rows(both, lo, RowSampling.build([guided(self.draw, self.guidance, 1), self.draw], logits.device))
        self.next_token: int | None = int(first[0])  # the host read syncs the device
        self.prefill_ms = (time.perf_counter() - start) * 1000
        self.slot: int | None = None  # a slot decoder's row, while the stream holds one
        self.row_len = grid.width + 1
        self._row = torch.empty(self.row_len, model.config.hidden_size, dtype=model.dtype, device=model.device)
        # What forwards made final and the stream has not committed yet, by raster index (``advance``).
        self.ready_hidden: dict[int, torch.Tensor] = {}
        self.ready_tokens: dict[int, int] = {}
        self.forwards = 0  # decode forwards this stream took part in
        self.decoding = decoding or Decoding()
        self.state = self.decoding.start(self)

    @property
    def done(self) -> bool:
        return self._complete

    @property
    def draw(self) -> Draw:
        """(allowed id range, sampling params, seed, step) of the token drawn next: ``sample_rows``' row inputs."""
        return self.draw_at(len(self.tokens))

    def draw_at(self, step: int) -> Draw:
        if self.feeds_last and step == self.grid.condition_positions:
            allowed = (self.image_end_id, self.image_end_id)  # the answer window's <|image end|>, forced
        else:
            allowed = allowed_token_range(step, self.grid, self.t2i)
        return allowed, self.sampling, self.seed, step

    def feeds(self, index: int) -> bool:
        """Whether token ``index`` (0-based) is fed back: every grid position; the look-ahead only under the answer
        window scope."""
        return index < self.grid.decode_tokens - 1 or (self.feeds_last and index == self.grid.decode_tokens - 1)

    def sample(self) -> bool:
        """Appends the drawn token; True when it must be fed (a forward is due), False when the stream is done."""
        if self._complete:
            return False
        if self.next_token is None:
            if self.state.may_stall and self.tokens:
                return True  # the last forward committed nothing: the same token still waits for its forward
            raise RuntimeError("no token drawn: accept() the last forward first")
        self.tokens.append(self.next_token)
        self.next_token = None
        if len(self.tokens) == self.grid.decode_tokens:
            check_image_condition(self.tokens, self.model.config, self.grid)
            if not self.feeds_last:
                self._finish()
                return False
        return True

    def _finish(self) -> None:
        self._complete = True
        self.cache = None  # free the K/V now
        if self.uncond is not None:
            self.uncond.cache = None

    @property
    def feed(self) -> tuple[int, int]:
        """(token id, position) of the forward this stream waits for."""
        return self.tokens[-1], self.prompt_len + len(self.tokens) - 1

    @property
    def uncond_offset(self) -> int:
        """How many positions the unconditional row's sequence lies behind this one's (guided streams only)."""
        assert self.uncond is not None, "only a guided stream has an unconditional row"
        return self.prompt_len - self.uncond.prompt_len

    def lanes(self) -> list[Lane]:
        """The tokens this stream feeds in the next forward (its decoding mode's choice; the first is the token
        ``sample()`` appended)."""
        return self.state.lanes()

    def advance(self, share: Forwarded) -> int:
        """Takes this stream's rows of a decode step (``Forwarded``) and commits, in raster order, every token that
        is now final (hidden state and the token drawn after it); returns how many it committed."""
        self.forwards += 1
        self.state.take(share.lanes, share.hidden, share.tokens)
        committed = 0
        while True:
            last = len(self.tokens) - 1
            if last not in self.ready_hidden or last + 1 not in self.ready_tokens:
                break
            self.accept(self.ready_hidden.pop(last), self.ready_tokens.pop(last + 1))
            committed += 1
            if self._complete or last + 1 not in self.ready_hidden or last + 2 not in self.ready_tokens:
                break
            if not self.sample():
                break
        return committed

    def accept(self, hidden: torch.Tensor, next_token: int) -> None:
        """Takes this stream's row of a decode forward: the fed token's hidden state [H] and the token it drew."""
        self.next_token = next_token
        i = len(self.tokens) - 1
        if self.feeds_last:
            self._recent.append((self.tokens[-1], hidden))
        if i == self.grid.condition_positions:  # <|image end|> was fed: the answer window is complete
            start = self.model.config.gen_vocab_start_index
            window = [h for token, h in self._recent if token >= start]
            self.image_condition = torch.stack(window).to("cpu")
            self._finish()
            if self.on_window is not None:
                self.on_window(self.image_condition)
            return
        self._row[i % self.row_len] = hidden
        if (i + 1) % self.row_len == 0:
            row = i // self.row_len
            ids = self.tokens[-self.row_len :]
            if min(ids) < self.model.config.gen_vocab_start_index:  # never with the grid sampler
                raise ConditionLengthError(f"grid row {row} holds ids outside the generation vocabulary")
            if self.on_row is not None:
                self.on_row(row, self._row.to("cpu", copy=True), torch.tensor(ids))


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
    guidance: float = 1.0,
    condition_scope: str = ALL_GENERATED,
    image_end_id: int | None = None,
    memo: PrefillMemo | None = None,
    decoding: Decoding | None = None,
) -> GridResult:
    """Decode the grid of one image alone (the engine's batched loop, batch of one); `on_prefill(text_condition)`
    fires before decoding. ``decoder`` defaults to an ``EagerDecoder(pad_to)``. ``guidance``, ``condition_scope``,
    ``image_end_id``, ``memo`` and ``decoding`` as ``DecodeStream`` takes them."""
    decoder = decoder or EagerDecoder(model, pad_to)
    rows: list[torch.Tensor] = []

    def keep_row(row: int, hidden: torch.Tensor, ids: torch.Tensor) -> None:
        rows.append(hidden)
        if on_row is not None:
            on_row(row, hidden, ids)

    stream = DecodeStream(model, prompt_ids, grid, t2i, sampling, seed, keep_row, prefix_ids, prefix, decoder.reserve,
                          guidance=guidance, condition_scope=condition_scope, image_end_id=image_end_id, memo=memo,
                          decoding=decoding)
    if on_prefill is not None:
        on_prefill(stream.text_condition)
    decoder.admit(stream)
    start = time.perf_counter()
    try:
        i = 0
        while True:
            if should_stop is not None and should_stop():
                raise GenerationCancelled(f"stopped after {i} of {grid.decode_tokens} tokens")
            if not stream.sample():
                break
            (share,) = decoder.step([stream])
            stream.advance(share)
            i += 1
    finally:
        decoder.release(stream)
    decode_ms = (time.perf_counter() - start) * 1000
    if stream.image_condition is not None:
        image = stream.image_condition
    else:
        image = torch.cat(rows, dim=0) if rows else torch.empty(0, model.config.hidden_size, dtype=model.dtype)
    return GridResult(stream.tokens, stream.text_condition, image, stream.prefill_ms, decode_ms, stream.forwards)
