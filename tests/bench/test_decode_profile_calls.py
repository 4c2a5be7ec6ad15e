"""bench.decode_profile's linear layers with FP8 weights: the calls it times are the Triton step's own (each e4m3
weight with its scales), and its cuBLAS baseline multiplies by the weights the FP8 ones came from.

The timing itself needs a GPU; what is timed is checked here, on the tiny model in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ar_service.model import decode_kernels
from ar_service.model.loading import load_ar
from ar_service.model.static_decode import StaticDecoder
from ar_service.model.tiny import write_ar_only_root
from bench.decode_profile import calls_bytes, cublas_weight, dequantized, linear_calls


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = write_ar_only_root(tmp_path_factory.mktemp("ckpt") / "tiny")
    return load_ar(root).model, load_ar(root, quantization="fp8").model


@pytest.mark.skipif(not decode_kernels.available, reason="triton is not installed")
def test_fp8_calls_carry_their_scales_and_time_the_kernels_the_step_runs(roots):
    plain, fp8 = (StaticDecoder(m, slots=2, max_positions=64, kernels="triton") for m in roots)
    plain_calls, fp8_calls = linear_calls(plain, 2), linear_calls(fp8, 2)
    assert plain_calls.keys() == fp8_calls.keys() == {"qkv", "o", "gate_up", "down", "gen_head"}
    for role, group in fp8_calls.items():
        for (x, w, extra), (_, w_plain, extra_plain) in zip(group, plain_calls[role], strict=True):
            assert w.dtype == torch.float8_e4m3fn and extra["scale"].shape == w.shape[:1], role
            assert extra_plain["scale"] is None and w_plain.shape == w.shape
            reference = cublas_weight(w, extra, x.dtype)  # the baseline's weight: close to the unquantized one
            assert reference.dtype == x.dtype and reference.shape == w.shape
            assert float((reference - w_plain.detach()).norm() / w_plain.detach().norm()) < 0.05, role
    # the bytes the bound is computed from: one per FP8 weight element against four for float32
    assert calls_bytes(fp8_calls) * 4 == calls_bytes(plain_calls)
    # the FP8 gen_head call is the step's: the kernel with its scales gives what cuBLAS gives on the baseline weight
    x, w, extra = fp8_calls["gen_head"][0]
    torch.testing.assert_close(decode_kernels.linear(x, w, **extra), F.linear(x, cublas_weight(w, extra, x.dtype)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not decode_kernels.available, reason="triton is not installed")
def test_the_tunes_bf16_comparison_runs_the_same_kernel_on_the_weights_the_fp8_ones_came_from(roots):
    """--tune times each FP8 weight beside the same Triton call on its dequantized bf16 weight: same extras (norm,
    SwiGLU, residual), no scales, the same product."""
    fp8 = StaticDecoder(roots[1], slots=2, max_positions=64, kernels="triton")
    for role, group in linear_calls(fp8, 2).items():
        plain = dequantized(group)
        for (x, w, extra), (x2, w2, extra2) in zip(group, plain, strict=True):
            assert x2 is x and extra2["scale"] is None and torch.equal(w2, cublas_weight(w, extra, x.dtype))
            assert {k: v for k, v in extra2.items() if k != "scale"} == {k: v for k, v in extra.items() if k != "scale"}
        x, w, extra = group[0]
        x2, w2, extra2 = plain[0]
        torch.testing.assert_close(decode_kernels.linear(x2, w2, **extra2), decode_kernels.linear(x, w, **extra),
                                   rtol=1e-4, atol=1e-4, msg=role)
