"""One image being decoded: its prefill, its cache or decoder slot, the grid it fills under the grid contract, and
with AR guidance its unconditional row.

Each generated token's hidden state appears when it is fed back in, so a row's hidden states are complete
right after its EOL is fed: that is when `on_row` streams the row. The final (look-ahead) token is never fed,
except under the released condition scopes (``FEEDS_IMAGE_END``: Preview's answer window, Dev's prompt tail), where
it is ``<|image end|>`` and is fed for its hidden state.

AR classifier-free guidance (released MammothModa2 ``mammothmoda2/model/modeling_mammothmoda2.py``
``generate_t2i``, qwen25vl branch, lines 254-262 and 305-306): a guided image decodes a second, unconditional row
that sees only the last ``UNCOND_PROMPT_TOKENS`` prompt tokens; every draw mixes the two rows' logits
(``ar_service.sampling.mix_guidance``) and both rows are then fed the token drawn.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from ar_service.conditions import (
    ALL_GENERATED,
    ANSWER_WINDOW,
    ANSWER_WINDOW_POSITIONS,
    CONDITION_SCOPES,
    FEEDS_IMAGE_END,
    PROMPT_TAIL,
    ConditionLengthError,
    check_image_condition,
    prompt_tail_rows,
    question_end,
)
from ar_service.decoding.modes import Decoding, Forwarded, Lane
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.prefill import PrefillMemo, PrefixCache, prefill_prompt, text_condition_of
from ar_service.prompt import Grid, allowed_token_range
from ar_service.sampling import Draw, RowSampling, SamplingParams, guided, sample_rows

RowCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
WindowCallback = Callable[[torch.Tensor], None]

#: Prompt tokens the unconditional row of AR guidance sees. The released ``generate_t2i`` doubles the batch and sets
#: ``attention_mask[unguided_bsz:, :-10] = 0``; Qwen2.5-VL then numbers that row's positions by the mask's running
#: sum (``get_rope_index``: ``attention_mask.cumsum(-1) - 1``, ``rope_deltas`` carried into decode), so the row is
#: exactly the last 10 prompt tokens at positions 0..9 followed by the generated tokens at 10, 11, ... For the
#: usual grids these 10 tokens are ``<|im_start|>assistant\n<|image start|>{w}*{h}<|image token|>``.
UNCOND_PROMPT_TOKENS = 10


class UnconditionalRow:
    """The second decode row of an AR-guided image: the last ``UNCOND_PROMPT_TOKENS`` prompt tokens as a sequence of
    their own (positions 0..9), then every token the image draws, one position further each (see the constant)."""

    def __init__(self, model: MammothModa2AR, prompt_ids: list[int], grid: Grid, reserve: bool,
                 memo: PrefillMemo | None = None) -> None:
        """``reserve``: as ``DecodeStream`` takes it. ``memo``: where a row of the same tokens may already be."""
        ids = prompt_ids[-UNCOND_PROMPT_TOKENS:]
        self.prompt_len = len(ids)

        def prefill() -> tuple[torch.Tensor, KVCache]:
            logits, _, cache = prefill_prompt(model, ids, KVCache(capacity=len(ids)))
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
    gets the image condition ([n, H] on the CPU, n = ``image_condition_positions``). Under ``prompt_tail`` the image
    condition is ``lead_condition`` (the prompt tail's generation ids, known at prefill), the rows, and the fed
    ``<|image end|>``'s state, which ``on_window`` gets alone ([1, H]).
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
        if condition_scope in FEEDS_IMAGE_END and image_end_id is None:
            raise ValueError(f"the {condition_scope} condition scope needs the <|image end|> id")
        self.model, self.grid, self.t2i, self.sampling, self.on_row = model, grid, t2i, sampling, on_row
        self.seed, self.guidance = seed, float(guidance)
        self.feeds_last = condition_scope in FEEDS_IMAGE_END
        self.windowed = condition_scope == ANSWER_WINDOW
        self.image_end_id, self.on_window = image_end_id, on_window
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = []
        self.image_condition: torch.Tensor | None = None  # the answer window, once complete
        self.image_end_condition: torch.Tensor | None = None  # prompt_tail's <|image end|> row, once fed
        self._complete = False
        start = time.perf_counter()
        logits, hidden, self.cache = prefill_prompt(
            model, prompt_ids, KVCache(capacity=total if reserve else len(prompt_ids)), prefix_ids, prefix
        )
        end = question_end(len(prompt_ids), grid, condition_scope, model.config.text_condition_with_answer)
        self.text_condition = text_condition_of(model, prompt_ids, hidden, end)
        # (id, condition state) of the last positions: the answer window's candidates, prompt positions first.
        self._recent: deque[tuple[int, torch.Tensor]] = deque(
            zip(prompt_ids[-ANSWER_WINDOW_POSITIONS:], hidden[-ANSWER_WINDOW_POSITIONS:], strict=True)
            if self.windowed else (), maxlen=ANSWER_WINDOW_POSITIONS,
        )
        # The image condition's rows that come from the prompt (prompt_tail), in order; [0, H] otherwise.
        lead = prompt_tail_rows(prompt_ids, model.config) if condition_scope == PROMPT_TAIL else []
        self.lead_condition = hidden[lead].to("cpu")
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
        if self.windowed:
            self._recent.append((self.tokens[-1], hidden))
        if i == self.grid.condition_positions:  # <|image end|> was fed: the image condition is complete
            start = self.model.config.gen_vocab_start_index
            if self.windowed:
                window = [h for token, h in self._recent if token >= start]
                self.image_condition = last = torch.stack(window).to("cpu")
            else:  # prompt_tail: the <|image end|> row, after the lead and the grid rows
                self.image_end_condition = last = hidden[None].to("cpu")
            self._finish()
            if self.on_window is not None:
                self.on_window(last)
            return
        self._row[i % self.row_len] = hidden
        if (i + 1) % self.row_len == 0:
            row = i // self.row_len
            ids = self.tokens[-self.row_len :]
            if min(ids) < self.model.config.gen_vocab_start_index:  # never with the grid sampler
                raise ConditionLengthError(f"grid row {row} holds ids outside the generation vocabulary")
            if self.on_row is not None:
                self.on_row(row, self._row.to("cpu", copy=True), torch.tensor(ids))

