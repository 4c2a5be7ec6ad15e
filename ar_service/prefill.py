"""Prefill: a prompt's forward over the AR, its condition states and its K/V.

The system prompt every T2I prompt starts with is prefilled once (``PrefixCache``) and split off each prompt, with
or without the cache, so that both ways compute the same bits. Prefills that repeat across requests (a negative
prompt, a guided image's unconditional row) are kept by their ids (``PrefillMemo``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from ar_service.conditions import text_condition_mask
from ar_service.model.configuration import ARConfig
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.prompt import system_prefix

T = TypeVar("T")


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


def prefill_prompt(
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


def text_condition_of(model: MammothModa2AR, prompt_ids: list[int], hidden: torch.Tensor, end: int | None = None):
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
    _, hidden, _ = prefill_prompt(model, prompt_ids, None, prefix_ids, prefix)
    return text_condition_of(model, prompt_ids, hidden), (time.perf_counter() - start) * 1000


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
        return prefill_prompt(model, negative_ids, None, prefix_ids, prefix)[1].cpu()

    condition = prefill() if memo is None else memo.get("negative", negative_ids, prefill)
    return condition, (time.perf_counter() - start) * 1000

