"""FP8 arithmetic (servicekit/fp8.py) against a plain reference, the FP8 linear layer, and the start-up refusal.

The reference rounds to e4m3 by searching the table of all 256 e4m3 bit patterns for the nearest finite value,
independently of torch's cast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ar_service.settings import ARSettings
from dit_service.settings import DiTSettings
from servicekit import fp8
from servicekit.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]

#: Every finite e4m3 value, from its bit patterns (0x7F and 0xFF are NaN in e4m3fn).
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value by table search (a tie between two values cannot occur for random floats)."""
    flat = x.double().reshape(-1, 1)
    return E4M3_VALUES[(flat - E4M3_VALUES[None]).abs().argmin(dim=1)].reshape(x.shape)


def reference_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = torch.stack([row.abs().max() / 448.0 for row in w.double()])
    return torch.stack([nearest_e4m3(row / s) for row, s in zip(w.double(), scales, strict=True)]), scales


def test_the_e4m3_table_is_what_the_format_promises():
    assert E4M3_VALUES.max() == 448.0 == fp8.E4M3_MAX and len(E4M3_VALUES) == 253  # +-0 collapse: 254 finite patterns


def test_weights_get_one_scale_per_output_channel_and_round_to_the_nearest_e4m3_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different ranges
    q, scale = fp8.quantize_weight(w)
    ref_q, ref_scale = reference_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (24,)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.double(), ref_q)
    assert (q.float().abs().amax(dim=1) == 448).all()  # each channel's largest weight lands on e4m3's largest value
    back = fp8.dequantize(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: a value within a channel's top binade is off by at most 1/16 of itself
    assert ((back - w).abs() <= w.abs().amax(dim=1, keepdim=True) / 16).all()
    assert float((back - w).norm() / w.norm()) < 0.04


def test_an_all_zero_channel_stays_zero():
    q, scale = fp8.quantize_weight(torch.zeros(3, 16))
    assert torch.isfinite(scale).all() and not q.float().any()
    xq, xs = fp8.quantize_rows(torch.zeros(2, 16))
    assert torch.isfinite(xs).all() and not xq.float().any()


def test_activations_get_one_scale_per_row_and_pad_with_zeros():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 20, generator=g) * torch.tensor([1e-2, 1.0, 30.0, 0.5, 4.0])[:, None]
    q, scale = fp8.quantize_rows(x, 32)
    assert q.shape == (5, 32) and scale.shape == (5, 1)
    ref_q, ref_scale = reference_weight(x)  # the per-row rule is the per-channel rule applied to rows
    torch.testing.assert_close(scale[:, 0].double(), ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q[:, :20].double(), ref_q)
    assert not q[:, 20:].float().any()


def test_the_scaled_product_equals_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 48, generator=g), torch.randn(32, 48, generator=g)
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_weight(w)
    got = fp8.scaled_mm(xq, xs, wq, ws, torch.float32)
    expected = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert float((got - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.06


@pytest.mark.parametrize(("k", "n", "bias"), [(48, 32, False), (40, 20, True)])  # 40, 20: padded to 48, 32
def test_a_dynamic_fp8_linear_computes_the_linear_it_replaces(k, n, bias):
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g))
    layer = fp8.FP8Linear(linear, "dynamic")
    assert layer.weight.shape == (fp8.padded(n), fp8.padded(k))
    x = torch.randn(2, 3, k, generator=g)
    got, expected = layer(x), linear(x).detach()
    assert got.shape == (2, 3, n)
    assert float((got - expected).norm() / expected.norm()) < 0.06
    wq, ws = fp8.quantize_weight(linear.weight.detach())
    xq, xs = fp8.quantize_rows(x.reshape(6, k))
    exact = ((xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()).reshape(2, 3, n)
    if bias:
        exact = exact + linear.bias.detach().double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_a_weight_only_fp8_linear_multiplies_by_the_dequantized_weight():
    g = torch.Generator().manual_seed(4)
    linear = nn.Linear(24, 40, bias=True)
    layer = fp8.FP8Linear(linear, "weight_only")
    assert layer.weight.shape == (40, 24) and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(3, 24, generator=g)
    wq, ws = fp8.quantize_weight(linear.weight.detach())
    expected = F.linear(x, wq.float() * ws[:, None], linear.bias.detach())
    torch.testing.assert_close(layer(x), expected)


def test_linears_reading_one_input_share_its_quantization():
    g = torch.Generator().manual_seed(5)
    layers = [fp8.FP8Linear(nn.Linear(40, n, bias=False), "dynamic") for n in (24, 8, 8)]
    x = torch.randn(2, 5, 40, generator=g)
    for got, layer in zip(fp8.shared_input(x, *layers), layers, strict=True):
        assert torch.equal(got, layer(x))
    plain = [nn.Linear(40, 8), nn.Linear(40, 8)]
    assert all(torch.equal(a, m(x)) for a, m in zip(fp8.shared_input(x, *plain), plain, strict=True))


def test_quantize_linears_replaces_the_named_linears_only():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    assert fp8.quantize_linears_(model, ["0"], "weight_only") == 1
    assert isinstance(model[0], fp8.FP8Linear) and type(model[2]) is nn.Linear
    with pytest.raises(TypeError, match="not an nn.Linear"):
        fp8.quantize_linears_(model, ["1"], "weight_only")


def test_fp8_is_refused_on_the_cpu_and_on_gpus_older_than_ada(monkeypatch):
    with pytest.raises(SystemExit, match="quantization fp8 needs a CUDA GPU of compute capability 8.9"):
        fp8.check_device("fp8", torch.device("cpu"), torch.bfloat16)
    fp8.check_device("none", torch.device("cpu"), torch.float32)  # the default runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match=r"NVIDIA A100-SXM4-80GB \(cuda:0\) has 8.0"):
        fp8.check_device("fp8", torch.device("cuda:0"), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_device("fp8", torch.device("cuda:0"), torch.bfloat16)
    with pytest.raises(SystemExit, match="fp8 runs in bfloat16 .* got dtype float16"):
        fp8.check_device("fp8", torch.device("cuda:0"), torch.float16)


@pytest.mark.parametrize("settings", [ARSettings, DiTSettings])
def test_quantization_is_a_setting_of_both_model_services(settings, tmp_path, monkeypatch):
    prefix = settings.model_config["env_prefix"]
    monkeypatch.delenv(f"{prefix}QUANTIZATION", raising=False)
    assert load_settings(settings, []).quantization == "none"
    assert load_settings(settings, ["--quantization", "fp8"]).quantization == "fp8"
    (tmp_path / "s.yaml").write_text("quantization: fp8\n")
    assert load_settings(settings, ["--config", str(tmp_path / "s.yaml")]).quantization == "fp8"
    monkeypatch.setenv(f"{prefix}QUANTIZATION", "fp8")
    assert load_settings(settings, []).quantization == "fp8"
    assert load_settings(settings, ["--quantization", "none"]).quantization == "none"  # the flag wins


@pytest.mark.parametrize("service", ["ar_service", "dit_service"])
def test_a_service_asked_for_fp8_on_the_cpu_exits_with_one_line(service, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARDIT_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", service, "--device", "cpu", "--quantization", "fp8", "--port", "0", "--random-weights",
         "--model-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "quantization fp8 needs a CUDA GPU of compute capability 8.9 or later (Ada, Hopper); the device is cpu"
    )
    assert "Traceback" not in done.stderr
    bad = subprocess.run([sys.executable, "-m", service, "--quantization", "int4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2 and "invalid choice: 'int4' (choose from 'none', 'fp8')" in bad.stderr


def test_without_triton_the_fp8_layers_and_the_dit_run_on_torch_arithmetic():
    """Triton is optional (CPU installs): the kernel modules still import, and an FP8 feed-forward and attention of
    the DiT compute with servicekit.fp8's torch arithmetic."""
    script = """
import sys
sys.modules["triton"] = sys.modules["triton.language"] = None  # as if Triton were not installed
import torch
from ar_service.model import decode_kernels
from dit_service.model import qk_rope_kernel
from dit_service.model.transformer import Attention, FeedForward, rope_tables
from servicekit import fp8_kernels
from servicekit.fp8 import FP8Linear
assert not (fp8_kernels.available or qk_rope_kernel.available or decode_kernels.available)
torch.manual_seed(0)
block = FeedForward(32, 64)
for name in ("linear_1", "linear_2", "linear_3"):
    setattr(block, name, FP8Linear(getattr(block, name), "dynamic", fp8_kernels.quantize_rows))
attention = Attention(32, heads=2, kv_heads=1)
cos, sin = rope_tables(torch.zeros(1, 5, 3, dtype=torch.long), (4, 6, 6))
x = torch.randn(1, 5, 32)
print(tuple(block(x).shape), tuple(attention(x, cos, sin, None).shape))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "(1, 5, 32) (1, 5, 32)"
