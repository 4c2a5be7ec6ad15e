"""The DiT's small building blocks, shared by the transformer (transformer.py) and the Q-Former (refiner.py): the
Qwen2-style RMSNorm, Lumina's SwiGLU feed-forward and its width rule, and the elementwise work between matmuls that
torch.compile fuses on CUDA. Facts as transformer.py's docstring gives them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from servicekit import fp8_kernels
from servicekit.fp8 import FP8Linear, shared_input

log = logging.getLogger(__name__)


#: torch.compile's limit of compiled variants per function, raised to this (process-wide) when a fused function
#: first compiles. One function serves inputs of several ranks, widths and layouts (RMSNorm: per token, and per
#: head of a column slice of a padded FP8 product); past torch's default of 8 a new variant silently ran unfused
#: (measured: ~7 ms of a 72 ms FP8 step at 1024x1024).
FUSED_RECOMPILE_LIMIT = 64


def fused_on_cuda(fn: Callable) -> Callable:
    """``fn`` (elementwise work between the matmuls) fused into one kernel by torch.compile when its first
    argument is on CUDA, with dynamic shapes (token counts vary by call); the plain function on the CPU, where
    the layout is kept bit-exact, or if compilation fails (logged once)."""
    state: dict = {"compiled": None, "failed": False}

    def call(*args):
        if args[0].is_cuda and not state["failed"]:
            if state["compiled"] is None:
                config = torch._dynamo.config
                config.recompile_limit = max(config.recompile_limit, FUSED_RECOMPILE_LIMIT)
                state["compiled"] = torch.compile(fn, dynamic=True)
            try:
                return state["compiled"](*args)
            except Exception:
                log.exception("torch.compile of %s failed; running it unfused", fn.__name__)
                state["failed"] = True
        return fn(*args)

    call.__name__ = fn.__name__
    return call


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


_fused_rms_norm = fused_on_cuda(_rms_norm)


@fused_on_cuda
def modulated_norm(x, weight, eps: float, scale, rows: torch.Tensor | None = None):
    """RMSNorm(x) * (1 + scale): a modulated block's attention and MLP input. ``scale`` broadcasts over x; or, for
    packed samples (x [1, N, D]), token i takes row ``rows[i]`` of ``scale`` [>= B, D], read inside the fused kernel
    (no [N, D] copy)."""
    if rows is not None:
        scale = scale[rows]
    return _rms_norm(x, weight, eps) * (1 + scale)


@fused_on_cuda
def gated_residual(x, gate, y, weight, eps: float, rows: torch.Tensor | None = None):
    """x + tanh(gate) * RMSNorm(y): a modulated block's residual update; ``gate`` and ``rows`` as ``modulated_norm``'s
    scale and rows."""
    if rows is not None:
        gate = gate[rows]
    return x + gate.tanh() * _rms_norm(y, weight, eps)


@fused_on_cuda
def _swiglu(gate, up):
    return F.silu(gate.float()).to(gate.dtype) * up


class RMSNorm(nn.Module):
    """Qwen2-style RMSNorm: normalise in float32, cast back, then scale (what the references substitute everywhere)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_rms_norm(x, self.weight, self.eps)


def ffn_inner_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """LuminaFeedForward width: 4*dim, optionally scaled, rounded up to a multiple (2520 -> 10240)."""
    inner = 4 * dim
    if ffn_dim_multiplier is not None:
        inner = int(ffn_dim_multiplier * inner)
    return multiple_of * ((inner + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, inner, bias=False)
        self.linear_2 = nn.Linear(inner, dim, bias=False)
        self.linear_3 = nn.Linear(dim, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = shared_input(x, self.linear_1, self.linear_3)
        down = self.linear_2
        if isinstance(down, FP8Linear) and down.activations == "dynamic" and fp8_kernels.supports(gate):
            # FP8 on CUDA: the SwiGLU product goes straight to e4m3 rows in one kernel (never written in bf16)
            xq, scale = fp8_kernels.triton_swiglu_quantize_rows(gate, up, down.weight.shape[1])
            return down.forward_quantized(xq, scale, gate.shape[:-1])
        return down(_swiglu(gate, up))


