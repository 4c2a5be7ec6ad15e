"""Triton kernels for the FP8 paths' memory-bound passes: quantizing activations per row, and widening weights.

Why: around each FP8 matmul the activations must be quantized (one scale per row) and, for the AR's prefill, the
e4m3 weights widened to bf16. Compiled from torch ops these took several passes each: on an H200 the DiT's
activation quantizer ran at about a fifth of the copy bandwidth (a row max in one kernel, the division, padding and
cast in another, with dynamic shapes), so a 1024x1024 step spent more in it than the FP8 matmuls saved
(``bench/dit_profile.py``), and the prefill's dequantize went through float32 copies of every weight. Here each
is one pass: a row is read once (a SwiGLU's two inputs too) and written once.

The arithmetic is ``servicekit.fp8``'s, bit for bit on the CPU and on the GPU (float32 products, one IEEE
division per row, round-to-nearest-even casts): ``quantize_rows``'s scale ``max(amax * (1 / 448), MIN_SCALE)``
and values ``clamp(x * (1 / scale))``, ``dequantize``'s ``q * scale`` cast once. ``triton_swiglu_quantize_rows``
computes the feed-forward's ``silu(gate) * up`` with the eager model's bf16 roundings and quantizes it, so the
product is never written in bf16; on the GPU its exponential is the hardware's approximation, so a value can
differ from torch's SwiGLU in its last bf16 bit.

``quantize_rows`` and ``dequantize`` take the kernels for CUDA tensors and ``servicekit.fp8``'s torch arithmetic
otherwise. The ``triton_*`` functions always run the kernels: on CUDA, or on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` before the import), which is how the tests check them (``servicekit.triton_support``
keeps the interpreter's casts exact).
"""

from __future__ import annotations

import torch

from servicekit import fp8
from servicekit.fp8 import FP8_DTYPE
from servicekit.triton_support import available, bf16_value, tl, to_bf16, to_e4m3, triton


def supports(tensor: torch.Tensor) -> bool:
    """Whether the dispatching functions take the kernels for ``tensor``: Triton is installed and it is on CUDA."""
    return available and tensor.is_cuda


if available:
    _E4M3_MAX = tl.constexpr(fp8.E4M3_MAX)
    _INVERSE_E4M3_MAX = tl.constexpr(1.0 / fp8.E4M3_MAX)
    _MIN_SCALE = tl.constexpr(fp8.MIN_SCALE)

    @triton.jit
    def _load_row_chunk(x_ptr, up_ptr, rows, cols, row_ok, k, x_stride, up_stride, SWIGLU: tl.constexpr):
        """A [rows, cols] chunk in float32 (zeros outside the rows' k columns); with SWIGLU, silu(x) * up with the
        eager model's roundings: silu in float32 -> bf16, times up in bf16."""
        inside = row_ok[:, None] & (cols[None, :] < k)
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if SWIGLU:
            up = tl.load(up_ptr + rows[:, None] * up_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            x = bf16_value(bf16_value(x / (1.0 + tl.exp(-x))) * up)
        return x

    @triton.jit
    def _store_quantized(q_ptr, x, inverse, rows, cols, row_ok, width, q_stride):
        q = to_e4m3(tl.minimum(tl.maximum(x * inverse[:, None], -_E4M3_MAX), _E4M3_MAX))
        tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], q, mask=row_ok[:, None] & (cols[None, :] < width))

    @triton.jit
    def _quantize_rows_kernel(x_ptr, up_ptr, q_ptr, scale_ptr, m, k, width, x_stride, up_stride, q_stride,
                              SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """BLOCK_M rows per program. When BLOCK_K covers the width, each row is read once and held; otherwise in two
        passes of BLOCK_K columns (the rows' amax, then their e4m3 values; the second pass re-reads them, mostly
        from L2). Columns from k to width get zeros."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < m
        if BLOCK_K >= width:
            cols = tl.arange(0, BLOCK_K)
            x = _load_row_chunk(x_ptr, up_ptr, rows, cols, row_ok, k, x_stride, up_stride, SWIGLU)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1) * _INVERSE_E4M3_MAX, _MIN_SCALE)
            _store_quantized(q_ptr, x, tl.math.div_rn(1.0, scale), rows, cols, row_ok, width, q_stride)
        else:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, k, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                x = _load_row_chunk(x_ptr, up_ptr, rows, cols, row_ok, k, x_stride, up_stride, SWIGLU)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale = tl.maximum(amax * _INVERSE_E4M3_MAX, _MIN_SCALE)
            inverse = tl.math.div_rn(1.0, scale)
            for start in range(0, width, BLOCK_K):
                cols = start + tl.arange(0, BLOCK_K)
                x = _load_row_chunk(x_ptr, up_ptr, rows, cols, row_ok, k, x_stride, up_stride, SWIGLU)
                _store_quantized(q_ptr, x, inverse, rows, cols, row_ok, width, q_stride)
        tl.store(scale_ptr + rows, scale, mask=row_ok)

    @triton.jit
    def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """(q * scale[row]) in float32, rounded once to bf16, for a [BLOCK_N, BLOCK_K] tile of a row-major [n, k]
        weight."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = (rows[:, None] < n) & (cols[None, :] < k)
        offsets = rows[:, None].to(tl.int64) * k + cols[None, :]
        q = tl.load(q_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + rows, mask=rows < n, other=0.0)
        tl.store(out_ptr + offsets, to_bf16(q * scale[:, None]), mask=inside)


def quantize_blocks(width: int) -> tuple[int, int, int]:
    """(rows per program, columns per chunk, warps) of the row quantizer for rows padded to ``width``: a row per
    program, held whole up to 16384 columns. On an H200 (8397 rows, as a 1024x1024 DiT step) this read 2520
    columns in 32 us (two passes of 512-2048 columns: 34-42 us) and a SwiGLU of 10240 in 150 us (186-191 us)."""
    if width > 16384:  # two passes over the row, 2048 columns at a time
        return 1, 2048, 8
    return 1, triton.next_power_of_2(width), 4 if width <= 4096 else 8


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _quantize(x: torch.Tensor, up: torch.Tensor | None, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows_2d(x)
    rows, k = x.shape
    width = k if width is None else width
    if width < k:
        raise ValueError(f"width {width} is narrower than the rows ({k})")
    swiglu = up is not None
    up = x if up is None else _rows_2d(up)  # unread without SWIGLU
    q = torch.empty(rows, width, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    if rows:
        block_m, block_k, warps = quantize_blocks(width)
        _quantize_rows_kernel[(triton.cdiv(rows, block_m),)](
            x, up, q, scale, rows, k, width, x.stride(0), up.stride(0), q.stride(0),
            SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps)
    return q, scale


def triton_quantize_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``servicekit.fp8.quantize_rows`` in one pass: x [..., K] -> (e4m3 [M, width], float32 scales [M, 1])."""
    return _quantize(x, None, width)


def triton_swiglu_quantize_rows(gate: torch.Tensor, up: torch.Tensor, width: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(silu(gate) * up)`` with the eager model's bf16 roundings, without writing the product."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _quantize(gate, up, width)


def triton_dequantize(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``servicekit.fp8.dequantize`` of an [N, K] weight with per-row scales [N] to bf16, in one pass."""
    quantized = quantized.contiguous()
    n, k = quantized.shape
    out = torch.empty(n, k, device=quantized.device, dtype=torch.bfloat16)
    if out.numel():
        grid = (triton.cdiv(n, 16), triton.cdiv(k, 256))
        _dequantize_kernel[grid](quantized, scale.contiguous(), out, n, k, BLOCK_N=16, BLOCK_K=256, num_warps=4)
    return out


def quantize_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``servicekit.fp8.quantize_rows``: the kernel on CUDA, the torch arithmetic elsewhere."""
    if supports(x):
        return triton_quantize_rows(x, width)
    return fp8.quantize_rows(x.reshape(-1, x.shape[-1]), width)


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``servicekit.fp8.dequantize`` of a weight: the kernel on CUDA to bf16, the torch arithmetic otherwise."""
    if supports(quantized) and dtype == torch.bfloat16:
        return triton_dequantize(quantized, scale)
    return fp8.dequantize(quantized, scale, dtype)
