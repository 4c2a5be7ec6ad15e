"""The VAE's GroupNorms on CUDA with each group's moments reduced across the whole GPU.

Why: PyTorch's CUDA GroupNorm reduces each (sample, group) pair in one thread block. The Flux VAE's decoder
normalises 32 groups of up to 16 channels x 1024 x 1024 values for a 1024x1024 image: 32 blocks on a GPU of 132
SMs, each running Welford's update value by value. On an H100 its 30 norms took 46 of the decode's 92 ms
(bench/results/h100/c1-step-overlap). Here the moments are two float32 sums (of x and of x squared) over each group,
which PyTorch's reduction spreads over every SM, and the normalisation is one multiply-add per value.

The arithmetic differs from PyTorch's kernel in the order of the float32 sums and in taking the variance as
E[x^2] - E[x]^2, so pixels may differ by a rounding step; the CPU keeps PyTorch's kernel (the tests' bit-exact path).
"""

from __future__ import annotations

import torch
from torch import nn


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``F.group_norm(x, groups, weight, bias, eps)`` for ``x`` [N, C, ...]: float32 moments, result in x's dtype."""
    n, channels = x.shape[:2]
    grouped = x.reshape(n, groups, -1)
    count = grouped.shape[-1]
    mean = grouped.sum(-1, dtype=torch.float32) / count
    mean_square = torch.linalg.vector_norm(grouped, 2, -1, dtype=torch.float32).square() / count
    rstd = torch.rsqrt((mean_square - mean.square()).clamp_min(0) + eps)
    per_channel = channels // groups
    scale = rstd.repeat_interleave(per_channel, 1)
    shift = -mean.repeat_interleave(per_channel, 1) * scale
    if weight is not None:
        scale = scale * weight.float()
        shift = shift * weight.float()
    if bias is not None:
        shift = shift + bias.float()
    view = (n, channels) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.view(view), x, scale.view(view)).to(x.dtype)


class ParallelGroupNorm(nn.GroupNorm):
    """An ``nn.GroupNorm`` that normalises CUDA tensors through ``group_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return super().forward(x)
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def use_parallel_group_norms(module: nn.Module) -> int:
    """Makes every plain ``nn.GroupNorm`` inside ``module`` a ``ParallelGroupNorm`` (same parameters); returns how
    many."""
    norms = [m for m in module.modules() if type(m) is nn.GroupNorm]
    for norm in norms:
        norm.__class__ = ParallelGroupNorm
    return len(norms)
