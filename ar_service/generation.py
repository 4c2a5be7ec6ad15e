"""The per-image decode loop: prefill the T2I prompt, then sample the visual-token grid under its contract.

Each generated token's hidden state appears when it is fed back in, so a row's hidden states are complete
right after its EOL is fed: that is when `on_row` streams the row. The final (look-ahead) token is never fed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ar_service.model.configuration import ARConfig
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.prompt import Grid, allowed_token_range, build_t2i_prompt
from ar_service.sampling import SamplingParams, sample_next

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


def _prefill(model: MammothModa2AR, prompt_ids: list[int], cache: KVCache | None):
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    device = model.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    positions = torch.arange(len(prompt_ids), device=device).unsqueeze(0)
    logits, hidden = model(ids, positions, cache, num_logits=1)
    mask = text_condition_mask(prompt_ids, model.config).to(device)
    return logits[:, -1], hidden[0][mask].cpu()


@torch.inference_mode()
def text_condition_for(
    model: MammothModa2AR, prompt_ids: list[int], config: ARConfig | None = None
) -> tuple[torch.Tensor, float]:
    """Prefill only (e.g. a negative prompt); `config` is accepted for callers that pass it, and unused."""
    start = time.perf_counter()
    _, text = _prefill(model, prompt_ids, None)
    return text, (time.perf_counter() - start) * 1000


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
) -> GridResult:
    """Decode exactly grid.decode_tokens tokens; `on_prefill(text_condition)` fires before decoding."""
    total = len(prompt_ids) + grid.decode_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"prompt + grid needs {total} positions; the model allows {model.config.max_position_embeddings}")
    device = model.device
    generator = torch.Generator(device="cpu").manual_seed(seed % 2**64)
    start = time.perf_counter()
    cache = KVCache(capacity=total)
    logits, text_condition = _prefill(model, prompt_ids, cache)  # .cpu() inside syncs the device
    prefill_ms = (time.perf_counter() - start) * 1000
    if on_prefill is not None:
        on_prefill(text_condition)

    start = time.perf_counter()
    row_len = grid.width + 1
    image = torch.empty(grid.condition_positions, model.config.hidden_size, dtype=model.dtype, device=device)
    tokens: list[int] = []
    step_ids = torch.empty(1, 1, dtype=torch.long, device=device)
    step_pos = torch.empty(1, 1, dtype=torch.long, device=device)
    for i in range(grid.decode_tokens):
        if should_stop is not None and should_stop():
            raise GenerationCancelled(f"stopped after {i} of {grid.decode_tokens} tokens")
        token = int(sample_next(logits, allowed_token_range(i, grid, t2i), sampling, generator)[0])
        tokens.append(token)
        if i == grid.decode_tokens - 1:
            break  # the look-ahead token: never fed, so it has no hidden state
        step_ids.fill_(token)
        step_pos.fill_(len(prompt_ids) + i)
        step_logits, hidden = model(step_ids, step_pos, cache)
        logits = step_logits[:, -1]
        image[i] = hidden[0, 0]
        if (i + 1) % row_len == 0:
            row = i // row_len
            if min(tokens[-row_len:]) < model.config.gen_vocab_start_index:  # never with the grid sampler
                raise ConditionLengthError(f"grid row {row} holds ids outside the generation vocabulary")
            if on_row is not None:
                rows = image[row * row_len : (row + 1) * row_len].to("cpu", copy=True)
                on_row(row, rows, torch.tensor(tokens[-row_len:]))
    decode_ms = (time.perf_counter() - start) * 1000
    check_image_condition(tokens, model.config, grid)
    return GridResult(tokens, text_condition, image.cpu(), prefill_ms, decode_ms)
