"""FP8 (e4m3) quantization shared by the two model services: the arithmetic, the device check and a linear layer.

Why: decode reads every weight once per token and a denoise step is matmul bound; e4m3 halves the bytes read and
doubles the tensor-core rate on Hopper-class GPUs. The scheme is the one the FP8 serving stacks use (vLLM's
``fp8`` with dynamic activation scales, torch's row-wise ``_scaled_mm``):

- weights: one float32 scale per output channel, ``amax(|W[n, :]|) / 448`` (448 is e4m3's largest finite value),
  ``W_fp8[n] = round_e4m3(W[n] / scale[n])``, so ``W ~= W_fp8 * scale[:, None]``;
- activations (DiT matmuls only): one scale per row (token), computed from that row's amax at run time;
- products accumulate in float32 and come out in bf16: ``x W^T ~= (x_fp8 W_fp8^T) * s_x[:, None] * s_w[None, :]``.

The AR runs weight-only FP8 (activations stay bf16; its kernels read fp8 weight tiles and scale the float32
accumulator per output channel): at one to sixteen rows a decode step is bound by the weight bytes alone.

Everything here runs on any device (torch casts to ``float8_e4m3fn`` on the CPU too, which is how the tests check
the arithmetic); ``scaled_mm`` and the FP8 matmul rate need CUDA compute capability 8.9 or later, which
``check_device`` enforces at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("none", "fp8")
#: The e4m3 format (finite values, no infinities: torch's ``float8_e4m3fn``).
FP8_DTYPE = torch.float8_e4m3fn
#: e4m3's largest finite magnitude (torch.finfo(torch.float8_e4m3fn).max).
E4M3_MAX = 448.0
#: Smallest scale used, so that an all-zero channel or row does not divide by zero.
MIN_SCALE = 1e-12
#: Hopper's ``_scaled_mm`` needs both dimensions of the weight operand (K and N) to be multiples of this.
ALIGN = 16
#: CUDA compute capability from which FP8 tensor-core matmuls exist (Ada 8.9, Hopper 9.0).
MIN_CAPABILITY = (8, 9)


def unsupported_reason(device: torch.device) -> str | None:
    """Why ``device`` cannot run FP8 (None when it can): the CPU, or a CUDA GPU older than compute capability 8.9."""
    if device.type != "cuda":
        return f"quantization fp8 needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} " \
               f"or later (Ada, Hopper); the device is {device}"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"quantization fp8 needs CUDA compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later; "
                f"{name} ({device}) has {capability[0]}.{capability[1]}")
    return None


def check_quantization(quantization: str) -> None:
    """Raises ValueError naming the accepted values unless ``quantization`` is one of QUANTIZATIONS."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be {' or '.join(map(repr, QUANTIZATIONS))}; got {quantization!r}")


def check_device(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses the start (one line, exit status 1) when ``quantization`` cannot run on ``device`` in ``dtype``."""
    try:
        check_quantization(quantization)
    except ValueError as unknown:
        raise SystemExit(str(unknown)) from None
    if quantization != "fp8":
        return
    if (reason := unsupported_reason(device)) is not None:
        raise SystemExit(reason)
    if dtype != torch.bfloat16:  # torch's row-wise _scaled_mm writes bf16
        raise SystemExit(f"quantization fp8 runs in bfloat16 (dtype auto or bfloat16); got dtype {str(dtype).removeprefix('torch.')}")


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scales [N]), one scale per output channel: amax / 448."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def dequantize(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 values times their scales ([N] per output channel of an [N, K] weight, or [M, 1] per row), in ``dtype``."""
    scale = scale if scale.ndim == quantized.ndim else scale[:, None]
    return (quantized.float() * scale).to(dtype)


def quantize_rows(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) quantization of activations x [M, K]: (e4m3 [M, width], float32 scales [M, 1]).
    ``width`` > K pads each row with zeros (``_scaled_mm``'s K must be a multiple of 16)."""
    xf = x.float()
    # products by reciprocals (one division per row), the same arithmetic as torch's CUDA scalar division and as
    # servicekit.fp8_kernels, so the quantized rows are the same bits on every device
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / E4M3_MAX)).clamp(min=MIN_SCALE)
    q = (xf * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    if width is not None and width > x.shape[-1]:
        q = F.pad(q, (0, width - x.shape[-1]))
    return q.to(FP8_DTYPE), scale


def scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(xq [M, K] * x_scale [M, 1]) @ (wq [N, K] * w_scale [N])^T in ``out_dtype``: torch's row-wise scaled matmul
    (tensor cores, float32 accumulation) on CUDA; elsewhere the same product computed in float32 (the reference)."""
    if xq.is_cuda:
        # _scaled_mm takes the second operand column-major: W [N, K] row-major transposed is exactly that.
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=out_dtype)
    return ((xq.float() @ wq.float().t()) * x_scale * w_scale[None, :]).to(out_dtype)


class FP8Linear(nn.Module):
    """A linear layer whose weight is held in e4m3 with per-output-channel scales, made from a bf16 ``nn.Linear``.

    ``activations``: "dynamic" (W8A8: each call quantizes its input per row and runs ``scaled_mm``; the weight is
    stored padded to multiples of 16 in both dimensions, the padding zero) or "weight_only" (the weight is
    dequantized to the input's dtype for the product: the AR's prefill, whose decode kernels read ``weight`` and
    ``weight_scale`` themselves). ``quantize``: the activation quantizer (``quantize_rows`` or a faster equivalent,
    such as ``servicekit.fp8_kernels.quantize_rows``); ``dequantize``: the weight widener of "weight_only" (likewise).
    """

    def __init__(
        self, linear: nn.Linear, activations: Literal["dynamic", "weight_only"],
        quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_rows,
        dequantize: Callable[..., torch.Tensor] = dequantize,
    ) -> None:
        super().__init__()
        if activations not in ("dynamic", "weight_only"):
            raise ValueError(f"activations must be 'dynamic' or 'weight_only'; got {activations!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activations, self._quantize, self._dequantize = activations, quantize, dequantize
        weight = linear.weight.detach()
        if activations == "dynamic":
            weight = F.pad(weight, (0, padded(self.in_features) - self.in_features,
                                    0, padded(self.out_features) - self.out_features))
        q, scale = quantize_weight(weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_dtype = linear.weight.dtype

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {self.activations}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "weight_only":
            return F.linear(x, self._dequantize(self.weight, self.weight_scale, x.dtype), self.bias)
        return self.forward_quantized(*self.quantize_input(x), x.shape[:-1])

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input's per-row e4m3 values and scales, padded to this layer's K: linears that read the same input
        (q/k/v, gate/up) quantize it once (``shared_input``)."""
        return self._quantize(x.reshape(-1, x.shape[-1]), self.weight.shape[1])

    def forward_quantized(self, xq: torch.Tensor, x_scale: torch.Tensor, lead: Sequence[int]) -> torch.Tensor:
        out = scaled_mm(xq, x_scale, self.weight, self.weight_scale, self.out_dtype)
        if self.out_features != out.shape[1]:
            out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, self.out_features)


def shared_input(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """Each of ``linears`` applied to ``x``; when they are all dynamic FP8 linears of the same input width, the
    input is quantized once for all of them."""
    fp8 = [m for m in linears if isinstance(m, FP8Linear) and m.activations == "dynamic"]
    if len(fp8) != len(linears) or len({m.weight.shape[1] for m in fp8}) != 1:
        return [m(x) for m in linears]
    xq, scale = fp8[0].quantize_input(x)
    return [m.forward_quantized(xq, scale, x.shape[:-1]) for m in fp8]


def quantize_linears_(
    root: nn.Module, names: Sequence[str], activations: Literal["dynamic", "weight_only"],
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] = quantize_rows,
    dequantize: Callable[..., torch.Tensor] = dequantize,
) -> int:
    """Replaces the ``nn.Linear`` submodules of ``root`` at the dotted ``names`` by ``FP8Linear``s (in place, one
    at a time, so that peak memory stays near the bf16 model's); returns how many were replaced. ``quantize`` and
    ``dequantize``: as ``FP8Linear``'s."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} is a {type(linear).__name__}, not an nn.Linear")
        setattr(parent, child, FP8Linear(linear, activations, quantize, dequantize))
        del linear
    return len(names)
