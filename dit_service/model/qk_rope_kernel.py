"""The attention's per-head RMSNorm of q or k and its RoPE rotation, as one Triton kernel.

Why: compiled from torch ops, the rotation of adjacent channel pairs (``transformer.apply_rope``) ran at about a
fifth of the copy bandwidth on an H200 and the norm before it was a separate pass: together ~5.7 ms of a 56-71 ms
guided step at 1024x1024 (``bench/dit_profile.py``), in bf16 and in FP8 alike. Here each token's heads are read
once and written once, already rotated.

Arithmetic as the eager model's: the norm in float32 (``x * rsqrt(mean(x^2) + eps)``), rounded to bf16, times the
norm's weight (rounded to bf16), then each pair (x0, x1) rotated in float32 to (x0 cos - x1 sin, x0 sin + x1 cos)
and rounded once more. The float32 sum runs in another order than torch's, and the GPU's ``rsqrt`` is its
hardware approximation, so results agree with the eager model to bf16 rounding, not to the bit.

Runs on CUDA tensors, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check it. ``supports`` says whether the attention takes it.
"""

from __future__ import annotations

import torch

from servicekit.triton_support import available, bf16_value, tl, to_bf16, triton


def supports(x: torch.Tensor) -> bool:
    """Whether the attention takes the kernel for ``x``: Triton is installed, ``x`` is a bf16 CUDA tensor."""
    return available and x.is_cuda and x.dtype == torch.bfloat16


if available:
    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, seq, heads, x_stride_b, x_stride_s,
                             table_stride_b, table_stride_s, eps,
                             HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One token per program: its heads [heads, HEAD_DIM] normalised, rotated and stored contiguously."""
        token = tl.program_id(0)
        b, s = token // seq, token % seq
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        inside = (h < heads) & (d < HEAD_DIM)
        x_row = x_ptr + b.to(tl.int64) * x_stride_b + s.to(tl.int64) * x_stride_s
        x = tl.load(x_row + h * HEAD_DIM + d, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        weight = tl.load(weight_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        x = bf16_value(weight * bf16_value(x * rstd[:, None]))
        x0, x1 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
        pair = tl.arange(0, BLOCK_D // 2)[None, :]
        table = b.to(tl.int64) * table_stride_b + s.to(tl.int64) * table_stride_s + pair
        cos = tl.load(cos_ptr + table, mask=pair < HEAD_DIM // 2, other=0.0)
        sin = tl.load(sin_ptr + table, mask=pair < HEAD_DIM // 2, other=0.0)
        rotated = tl.reshape(tl.join(x0 * cos - x1 * sin, x0 * sin + x1 * cos), (BLOCK_H, BLOCK_D))
        out_row = out_ptr + token.to(tl.int64) * heads * HEAD_DIM
        tl.store(out_row + h * HEAD_DIM + d, to_bf16(rotated), mask=inside)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
                 ) -> torch.Tensor:
    """``apply_rope(RMSNorm(x), cos, sin)`` for q or k ``x`` [B, S, H, D] (bf16; each token's heads side by side,
    any token strides: a column slice of a padded FP8 product too) with cos, sin [B, S, D/2] (float32); returns a
    contiguous [B, S, H, D]."""
    b, s, heads, dim = x.shape
    if x.stride(3) != 1 or x.stride(2) != dim:
        x = x.contiguous()
    cos, sin = cos.float(), sin.float()
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape != (b, s, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{b}, {s}, {dim // 2}]; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    out = torch.empty(b, s, heads, dim, device=x.device, dtype=torch.bfloat16)
    if out.numel():
        _qk_norm_rope_kernel[(b * s,)](
            x, weight, cos, sin, out, s, heads, x.stride(0), x.stride(1), cos.stride(0), cos.stride(1), eps,
            HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
    return out
