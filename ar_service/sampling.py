"""Constrained next-token sampling, row by row, on whatever device holds the logits.

Each row has its own id range, temperature, top-k, top-p, seed and step. The draw is Gumbel-max: the token is
the argmax of ``logits / temperature + g`` over the ids that survive the range, top-k and top-p filters, with
``g = -log(-log(u))`` and ``u`` a counter-based hash of (seed, step, token id). That is a draw from the
filtered softmax distribution (the Gumbel-max identity), and, unlike a stateful generator shared by a batch,
a row's draw depends only on its own seed, step and logits: batch-invariant, the same on CPU and CUDA for the
same logits, and free of host round trips, so the GPU decode step samples inside its CUDA graph.

AR classifier-free guidance (released MammothModa2, ``mammothmoda2/utils/logits_processor.py``
``ClassifierFreeGuidanceLogitsProcessor``, applied first in ``modeling_mammothmoda2.py`` ``generate_t2i``): a guided
row names the row holding its unconditional logits (``partner``) and its scale; its float32 logits become
``uncond + (cond - uncond) * scale`` before anything else (the allowed range, temperature, top-k, top-p). Rows with a
scale <= 1 keep their own logits untouched, so an unguided row's draw is what it was without guidance support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M31 = 2**31 - 1
#: The multiplier of the widely used 32-bit integer hash ``x = ((x >> 16) ^ x) * 0x45d9f3b`` (three rounds).
_HASH_MULTIPLIER = 0x45D9F3B


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


#: One row's draw inputs: (allowed id range (inclusive), params, seed, step), optionally followed by the AR guidance
#: scale and the index of the row with the unconditional logits (absent: 1.0, the row itself).
Draw = tuple


@dataclass
class RowSampling:
    """Per-row sampling inputs as tensors [B] on one device (a CUDA graph reads them in place)."""

    lo: torch.Tensor  # int64, first allowed id (absolute)
    hi: torch.Tensor  # int64, last allowed id (inclusive)
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, <= 0: off
    top_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64, >= 0
    step: torch.Tensor  # int64, index of the token being drawn
    partner: torch.Tensor  # int64, the row holding this row's unconditional logits (itself when unguided)
    guidance: torch.Tensor  # float32, AR guidance scale; <= 1: off

    @classmethod
    def from_columns(cls, ints: torch.Tensor, floats: torch.Tensor) -> RowSampling:
        """Views of ``ints`` [B, 6] (``draw_columns``' first list per row) and ``floats`` [B, 3] (its second)."""
        return cls(lo=ints[:, 0], hi=ints[:, 1], top_k=ints[:, 2], seed=ints[:, 3], step=ints[:, 4], partner=ints[:, 5],
                   temperature=floats[:, 0], top_p=floats[:, 1], guidance=floats[:, 2])

    @classmethod
    def build(cls, rows: list[Draw], device) -> RowSampling:
        """From one ``Draw`` per row (row b's default partner is row b)."""
        ints, floats = zip(*(draw_columns(draw, b) for b, draw in enumerate(rows)), strict=True)
        return cls.from_columns(torch.tensor(ints, dtype=torch.long, device=device),
                                torch.tensor(floats, dtype=torch.float32, device=device))


def guided(draw: Draw, guidance: float, partner: int) -> Draw:
    """``draw`` with an AR guidance scale and the row of its unconditional logits."""
    return (*draw[:4], float(guidance), partner)


def draw_columns(draw: Draw, row: int = 0) -> tuple[list[int], list[float]]:
    """One row's draw (``Draw``) as the integer columns (lo, hi, top_k, seed, step, partner) and the float columns
    (temperature, top_p, guidance) that ``RowSampling.from_columns`` reads; ``row`` is its own index (the partner of
    an unguided row)."""
    (lo, hi), params, seed, step, *guide = draw
    guidance, partner = guide if guide else (1.0, row)
    return [lo, hi, params.top_k, seed % 2**63, step, partner], [params.temperature, params.top_p, guidance]


def mix_guidance(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Float32 logits [B, V] with each guided row replaced by ``uncond + (cond - uncond) * scale`` (uncond: its
    partner row's logits); unguided rows are returned as they came (bit for bit)."""
    logits = logits.float()
    uncond = logits.index_select(0, rows.partner)
    mixed = uncond + (logits - uncond) * rows.guidance[:, None]
    return torch.where((rows.guidance > 1.0)[:, None], mixed, logits)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """31-bit integer hash (products stay below 2**58: no int64 overflow on any device)."""
    for _ in range(3):
        x = ((x ^ (x >> 16)) * _HASH_MULTIPLIER) & _M31
    return x


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] for token ``ids`` [V] of rows with ``seed``/``step`` [B]: a pure function of the three."""
    seed_low = seed & _M31
    seed_high = ((seed >> 31) & _M31) ^ (seed >> 62)
    key = _mix(_mix(_mix(seed_low) ^ seed_high) ^ (step & _M31))  # [B]
    bits = _mix(key[:, None] ^ ids[None, :]) >> 7  # 24 random bits
    u = (bits.float() + 0.5) * (1.0 / 2**24)  # strictly inside (0, 1)
    return -torch.log(-torch.log(u))


def sample_rows(logits: torch.Tensor, offset: int, rows: RowSampling, noise=gumbel_noise) -> torch.Tensor:
    """One id per row of ``logits`` [B, V] (column j is id ``offset + j``): int64 [B], absolute ids. ``noise``:
    ``gumbel_noise`` or a compiled copy of it (the fast decode step fuses its ~50 integer ops into one kernel).

    Filters as the reference samplers do: AR guidance first (``mix_guidance``), then the allowed range, temperature,
    top-k, then top-p over what top-k kept (the best token always stays). Only tensor ops with fixed shapes:
    capturable in a CUDA graph.
    """
    b, v = logits.shape
    device = logits.device
    logits = mix_guidance(logits, rows)
    ids = torch.arange(v, device=device) + offset
    allowed = (ids[None] >= rows.lo[:, None]) & (ids[None] <= rows.hi[:, None])
    greedy = rows.temperature <= 0
    scale = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    scores = (logits.float() / scale[:, None]).masked_fill(~allowed, float("-inf"))
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=device)[None]
    k = torch.where((rows.top_k > 0) & (rows.top_k < v), rows.top_k, torch.full_like(rows.top_k, v))
    ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the best one always stays.
    drop = (probs.cumsum(dim=-1) - probs >= rows.top_p[:, None]) & (rank > 0)
    ordered = ordered.masked_fill(drop, float("-inf"))
    noise = noise(rows.seed, rows.step, ids).gather(1, order)
    noisy = torch.where(greedy[:, None], ordered, ordered + noise)
    pick = noisy.argmax(dim=-1, keepdim=True)
    return order.gather(1, pick).squeeze(1) + offset
