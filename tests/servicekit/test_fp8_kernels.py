"""The FP8 Triton kernels (servicekit/fp8_kernels.py) against servicekit.fp8's torch arithmetic, bit for bit.

They run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), the same kernels
the GPU runs; the DiT's feed-forward is checked through its fused path by letting the kernels take CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dit_service.model.transformer import FeedForward
from servicekit import fp8, fp8_kernels
from servicekit.fp8 import FP8Linear

pytestmark = pytest.mark.skipif(not fp8_kernels.available, reason="Triton is not installed")

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_each_e4m3_value_and_each_tie_between_two_rounds_as_torch_rounds():
    """A row whose amax is 448 has scale 1, so the row's values meet the rounding as they are: every e4m3 value
    must come back unchanged and each midpoint between neighbours must go to the even one (bf16 holds both)."""
    positive = E4M3_VALUES[E4M3_VALUES >= 0]
    midpoints = (positive[1:] + positive[:-1]) / 2
    row = torch.cat([E4M3_VALUES, midpoints, -midpoints, torch.tensor([448.0])]).to(torch.bfloat16)
    assert torch.equal(row.float(), torch.cat([E4M3_VALUES, midpoints, -midpoints, torch.tensor([448.0])]))
    q, scale = fp8_kernels.triton_quantize_rows(row[None])
    ref_q, ref_scale = fp8.quantize_rows(row[None])
    assert float(scale) == 1.0 and torch.equal(scale, ref_scale)
    assert same_bits(q, ref_q)
    assert torch.equal(q[0, : len(E4M3_VALUES)].float(), E4M3_VALUES)


def test_rows_of_any_magnitude_quantize_as_the_torch_arithmetic_with_padding_zero():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 100, generator=g) * torch.logspace(-6, 4, 9)[:, None]).to(torch.bfloat16)
    x[4] = 0  # an all-zero row: the smallest scale, zeros out
    q, scale = fp8_kernels.triton_quantize_rows(x, 112)
    ref_q, ref_scale = fp8.quantize_rows(x, 112)
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)
    assert q.shape == (9, 112) and not q[:, 100:].float().any()
    assert float(scale[4]) == torch.tensor(fp8.MIN_SCALE).item() and not q[4].float().any()


def test_a_column_slice_of_a_wider_output_and_a_3d_input_are_read_through_their_strides():
    """The DiT's padded FP8 products come out [M, 2528] and are sliced to 2520 columns before the next layer."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 5, 48, generator=g).to(torch.bfloat16)
    x = wide[..., :40]
    q, scale = fp8_kernels.triton_quantize_rows(x, 48)
    ref_q, ref_scale = fp8.quantize_rows(x.reshape(10, 40), 48)
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)


def test_rows_wider_than_one_block_are_quantized_in_two_passes_with_the_same_result():
    g = torch.Generator().manual_seed(5)
    k = 16400  # past the widest row a program holds whole: the amax pass, then the quantizing pass
    assert fp8_kernels.quantize_blocks(k)[1] < k
    x = (torch.randn(3, k, generator=g) * torch.tensor([[1e-3], [1.0], [1e3]])).to(torch.bfloat16)
    q, scale = fp8_kernels.triton_quantize_rows(x, k + 16)
    ref_q, ref_scale = fp8.quantize_rows(x, k + 16)
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)
    gate, up = (torch.randn(2, 2, k, generator=g) * 4).to(torch.bfloat16)
    q, scale = fp8_kernels.triton_swiglu_quantize_rows(gate, up)
    ref_q, ref_scale = fp8.quantize_rows(F.silu(gate.float()).to(torch.bfloat16) * up)
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)


def test_no_rows_give_empty_results_and_a_narrower_width_is_refused():
    q, scale = fp8_kernels.triton_quantize_rows(torch.zeros(0, 32, dtype=torch.bfloat16), 48)
    assert q.shape == (0, 48) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="width 16 is narrower than the rows"):
        fp8_kernels.triton_quantize_rows(torch.zeros(2, 32, dtype=torch.bfloat16), 16)


def test_the_fused_swiglu_quantizer_equals_the_swiglu_then_the_quantizer():
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(2, 33, 200, generator=g) * 4).to(torch.bfloat16)
    q, scale = fp8_kernels.triton_swiglu_quantize_rows(gate, up, 208)
    ref_q, ref_scale = fp8.quantize_rows(F.silu(gate.float()).to(torch.bfloat16) * up, 208)
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)
    with pytest.raises(ValueError, match=r"gate \(33, 200\) and up \(33, 100\) differ"):
        fp8_kernels.triton_swiglu_quantize_rows(gate, up[:, :100])


def test_weights_widen_to_the_same_bf16_values_as_the_torch_arithmetic():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 300, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    q, scale = fp8.quantize_weight(weight)
    assert torch.equal(fp8_kernels.triton_dequantize(q, scale), fp8.dequantize(q, scale, torch.bfloat16))


def test_the_dispatch_takes_torch_arithmetic_off_cuda():
    """On the CPU (outside the interpreter's explicit calls) the service paths keep servicekit.fp8's arithmetic,
    in any dtype."""
    q, scale = fp8.quantize_weight(torch.randn(8, 16))
    assert not fp8_kernels.supports(q)
    assert torch.equal(fp8_kernels.dequantize(q, scale, torch.float32), fp8.dequantize(q, scale, torch.float32))


def test_the_dit_feed_forward_takes_the_fused_swiglu_quantizer_with_the_same_result(monkeypatch):
    """FP8 feed-forward: the SwiGLU product goes to e4m3 in one kernel instead of being written in bf16 first."""
    torch.manual_seed(4)
    block = FeedForward(64, 256).to(torch.bfloat16)
    for name in ("linear_1", "linear_2", "linear_3"):
        setattr(block, name, FP8Linear(getattr(block, name), "dynamic", fp8_kernels.quantize_rows))
    x = torch.randn(3, 7, 64).to(torch.bfloat16)
    unfused = block(x)
    calls = []
    fused_quantizer = fp8_kernels.triton_swiglu_quantize_rows
    monkeypatch.setattr(fp8_kernels, "supports", lambda tensor: True)
    monkeypatch.setattr(fp8_kernels, "triton_swiglu_quantize_rows", lambda *a: calls.append(1) or fused_quantizer(*a))
    fused = block(x)
    assert calls and fused.shape == (3, 7, 64)
    assert torch.equal(fused, unfused)
