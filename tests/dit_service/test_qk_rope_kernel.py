"""The attention's fused q/k RMSNorm + RoPE kernel (dit_service/model/qk_rope_kernel.py) against the eager path it
replaces on CUDA, run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from dit_service.model import qk_rope_kernel
from dit_service.model.transformer import Attention, RMSNorm, apply_rope, rope_tables

pytestmark = pytest.mark.skipif(not qk_rope_kernel.available, reason="Triton is not installed")


def tables(b: int, s: int, axes=(8, 4, 4)):
    g = torch.Generator().manual_seed(0)
    return rope_tables(torch.randint(0, 50, (b, s, 3), generator=g), axes)


def bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the larger value's bf16 step (2^-7 relative)."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp(min=1e-3)
    return float(((a.float() - b.float()).abs() / scale).max() * 128)


@pytest.mark.parametrize("heads", [3, 7])
@torch.no_grad()
def test_the_kernel_normalises_and_rotates_as_the_eager_path(heads):
    torch.manual_seed(1)
    b, s, dim = 2, 5, 16
    norm = RMSNorm(dim).to(torch.bfloat16)
    norm.weight.data = (torch.rand(dim) + 0.5).to(torch.bfloat16)
    x = (torch.randn(b, s, heads, dim) * 3).to(torch.bfloat16)
    cos, sin = tables(b, s)
    got = qk_rope_kernel.qk_norm_rope(x, norm.weight, norm.eps, cos, sin)
    want = apply_rope(norm(x), cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    assert bf16_steps_apart(got, want) <= 1.0
    assert (got == want).float().mean() > 0.95  # most values are the same bits


def test_a_column_slice_of_a_padded_product_is_read_through_its_token_stride():
    """FP8 products come out padded ([tokens, 2528] for 2520 columns) and are sliced before the norm."""
    torch.manual_seed(2)
    wide = torch.randn(1, 6, 3 * 16 + 8).to(torch.bfloat16)
    x = wide[..., : 3 * 16].view(1, 6, 3, 16)
    weight = torch.ones(16, dtype=torch.bfloat16)
    cos, sin = tables(1, 6)
    got = qk_rope_kernel.qk_norm_rope(x, weight, 1e-5, cos, sin)
    assert torch.equal(got, qk_rope_kernel.qk_norm_rope(x.contiguous(), weight, 1e-5, cos, sin))


def test_tables_of_the_wrong_shape_are_refused():
    x = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    cos, sin = tables(1, 3)
    with pytest.raises(ValueError, match=r"cos and sin must be \[1, 4, 8\]"):
        qk_rope_kernel.qk_norm_rope(x, torch.ones(16, dtype=torch.bfloat16), 1e-5, cos, sin)


@torch.no_grad()
def test_the_attention_takes_the_kernel_with_a_result_within_rounding(monkeypatch):
    torch.manual_seed(3)
    attention = Attention(48, heads=3, kv_heads=1).to(torch.bfloat16)
    x = torch.randn(2, 6, 48).to(torch.bfloat16)
    cos, sin = tables(2, 6)
    eager = attention(x, cos, sin, None)
    calls = []
    kernel = qk_rope_kernel.qk_norm_rope
    monkeypatch.setattr(qk_rope_kernel, "supports", lambda tensor: tensor.dtype == torch.bfloat16)
    monkeypatch.setattr(qk_rope_kernel, "qk_norm_rope", lambda *a: calls.append(1) or kernel(*a))
    fused = attention(x, cos, sin, None)
    assert len(calls) == 2  # q and k
    assert float((fused.float() - eager.float()).norm() / eager.float().norm()) < 0.01
