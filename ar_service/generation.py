"""One image's grid, decoded alone: prefill, then the decode loop until the grid is complete (the engine's batched loop
with a batch of one). The parts live in their own modules: ``conditions`` (which states condition the DiT),
``prefill`` (the prompt's forward, shared prefix and memo), ``decoding`` (the modes, the stream, the decoders)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ar_service.conditions import ALL_GENERATED
from ar_service.decoding.decoders import DEFAULT_PAD_TO, EagerDecoder, SlotDecoder
from ar_service.decoding.modes import Decoding
from ar_service.decoding.stream import DecodeStream, RowCallback
from ar_service.model.modeling import MammothModa2AR
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.prefill import PrefillMemo, PrefixCache
from ar_service.prompt import Grid
from ar_service.sampling import SamplingParams


class GenerationCancelled(Exception):
    """Raised inside the decode loop when `should_stop()` says the request is gone."""


@dataclass
class GridResult:
    token_ids: list[int]  # all grid.decode_tokens ids, look-ahead included
    text_condition: torch.Tensor  # [Lt, H]
    image_condition: torch.Tensor  # [image_condition_positions, H] (conditions.py)
    prefill_ms: float
    decode_ms: float
    forwards: int = 0  # decode forwards (steps) the grid took


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
    else:  # the grid's rows, after the prompt's lead rows and before <|image end|>'s under prompt_tail
        tail = [] if stream.image_end_condition is None else [stream.image_end_condition]
        parts = [stream.lead_condition.to(model.dtype), *rows, *tail]
        image = torch.cat(parts, dim=0) if parts else torch.empty(0, model.config.hidden_size, dtype=model.dtype)
    return GridResult(stream.tokens, stream.text_condition, image, stream.prefill_ms, decode_ms, stream.forwards)
