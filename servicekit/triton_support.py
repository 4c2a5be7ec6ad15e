"""Triton for the project's kernels: whether it is installed, whether its interpreter runs the kernels, and float32
-> bf16 / -> e4m3 roundings that give the same bits on the GPU and in the interpreter.

Why one module: the AR's decode kernels, the FP8 kernels and the DiT's q/k kernel all need the same import guard
(Triton is optional: CPU installs run torch's arithmetic) and the same reading of ``TRITON_INTERPRET=1`` (the
kernels then take CPU tensors, which is how the tests check them without a GPU).

The roundings: the interpreter casts float32 to bf16 by truncation and to e4m3 with a rounding that can overflow
the mantissa; the hardware rounds both to nearest even. In the interpreter these helpers round in float32
arithmetic first, so that the casts only meet representable values; on the GPU they are the plain casts.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: callers use torch's arithmetic instead of the kernels
    triton = tl = None

#: Whether Triton imported.
available = triton is not None
#: Triton's interpreter (TRITON_INTERPRET=1 when this module was imported): the kernels take CPU tensors.
interpreting = os.environ.get("TRITON_INTERPRET") == "1"

if available:
    _IN_ARITHMETIC = tl.constexpr(interpreting)
    #: e4m3's smallest normal magnitude, 2^-6; below it values are multiples of 2^-9.
    _E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
    #: 1.5 * 2^14: a float32 sum with it has a unit in the last place of 2^-9.
    _E4M3_SUBNORMAL_SHIFTER = tl.constexpr(1.5 * 2.0**14)

    @triton.jit
    def bf16_value(x):
        """x (float32) rounded to the nearest bf16 value, ties to even, as float32."""
        if _IN_ARITHMETIC:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def to_e4m3(x):
        """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as e4m3."""
        if _IN_ARITHMETIC:
            bits = x.to(tl.uint32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
            magnitude = (tl.abs(x) + _E4M3_SUBNORMAL_SHIFTER) - _E4M3_SUBNORMAL_SHIFTER  # sign put back: -0 stays
            subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
            x = tl.where(tl.abs(x) < _E4M3_MIN_NORMAL, subnormal, normal)
        return x.to(tl.float8e4nv)

    @triton.jit
    def to_bf16(x):
        """x (float32) rounded to the nearest bf16 value, ties to even, as bf16."""
        return bf16_value(x).to(tl.bfloat16)
else:  # the names exist for importers; without Triton nothing calls them
    bf16_value = to_bf16 = to_e4m3 = None
