"""Constrained next-token sampling: range mask, temperature, top-k, top-p, then multinomial."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k <= 0 or >= range size and top_p >= 1 are no-ops."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_next(
    logits: torch.Tensor, allowed: tuple[int, int], params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """Sample one id per row of `logits` [B, V] from the inclusive range `allowed`.

    Everything outside the range has probability zero, so we work on the range's slice of the
    logits (same distribution as masking to -inf, and far less work for a 184k vocabulary).
    Runs on the generator's device so a CPU generator gives the same draw for any model device.
    """
    lo, hi = allowed
    if not 0 <= lo <= hi < logits.shape[-1]:
        raise ValueError(f"allowed range [{lo}, {hi}] is outside the vocabulary of {logits.shape[-1]}")
    scores = logits[:, lo : hi + 1].to(device=generator.device, dtype=torch.float32)
    if params.temperature == 0:
        return scores.argmax(dim=-1) + lo
    scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the best one always stays.
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        drop[:, 0] = False
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1) + lo
