"""FP8 weights in the AR (``load_ar(quantization="fp8")``): what is quantized, prefill and both decode kernel sets.

The tiny model runs in float32 on the CPU; the Triton kernels run in Triton's interpreter (tests/conftest.py), so
their FP8 weight loads, per-channel scaling and SwiGLU/residual folding are checked here. Their speed, and the
bf16 activations of a real GPU, are bench/fp8_check.py's business.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ar_service.conditions import prompt_ids_for
from ar_service.decoding.decoders import SlotDecoder
from ar_service.generation import generate_grid
from ar_service.model import decode_kernels
from ar_service.model.loading import load_ar
from ar_service.model.quantize import fp8_linear_names
from ar_service.model.static_decode import StaticDecoder, _rms_norm
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from servicekit.fp8 import FP8Linear, dequantize, quantize_weight

triton_only = pytest.mark.skipif(not decode_kernels.available, reason="triton is not installed")


@pytest.fixture(scope="module")
def fp8_ar(tiny_root):
    return load_ar(tiny_root, quantization="fp8")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_the_decode_path_linears_and_the_generation_head_are_fp8_the_rest_is_not(fp8_ar, tiny_ar):
    model = fp8_ar.model
    fp8_names = {name for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert fp8_names == set(fp8_linear_names(model))
    linears = {name for name, m in tiny_ar.model.named_modules() if isinstance(m, nn.Linear)}
    assert fp8_names == linears - {"lm_head"}  # every linear but the text head
    assert type(model.lm_head) is nn.Linear
    text = model.model.language_model
    assert text.embed_tokens.weight.dtype == text.gen_embed_tokens.weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, FP8Linear))
    experts = [n for n in fp8_names if ".gen_" in n]
    assert experts, "the tiny model has expert layers, and they are quantized too"


def test_unknown_quantization_is_refused(tiny_root):
    with pytest.raises(ValueError, match="quantization must be 'none' or 'fp8'; got 'int8'"):
        load_ar(tiny_root, quantization="int8")


def test_fp8_prefill_stays_near_the_unquantized_model(fp8_ar, tiny_ar):
    ids = torch.tensor([prompt_ids_for(tiny_ar.tokenizer, "a red cube", grid_for_size(32, 32, 16))])
    with torch.no_grad():
        (logits, hidden), (ref_logits, ref_hidden) = fp8_ar.model(ids), tiny_ar.model(ids)
    assert 0 < rel(hidden, ref_hidden) < 0.1
    assert 0 < rel(logits, ref_logits) < 0.1


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=triton_only)])
def test_the_fixed_slot_decoder_decodes_the_fp8_model_as_its_eager_decoder_does(fp8_ar, kernels, monkeypatch):
    """Same grid of tokens and condition rows: the decode step reads the quantized weights and their scales exactly
    as the eager (dequantizing) path multiplies them."""
    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", 2)  # the interpreter runs programs one by one
    t2i = fp8_ar.t2i
    sampling = SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p)
    prefix = build_prefix_cache(fp8_ar.model, system_prefix_ids(fp8_ar.tokenizer))
    # Triton's interpreter takes seconds a step here (the dot-free kernel runs a program per two output channels):
    # its grid is one row of two tokens, its end of line and the look-ahead
    grid = grid_for_size(32, 32 if kernels == "torch" else 16, 16)
    ids = prompt_ids_for(fp8_ar.tokenizer, "a cat", grid)
    eager = generate_grid(fp8_ar.model, ids, grid, t2i, sampling, 5, prefix=prefix, pad_to=2)
    static = StaticDecoder(fp8_ar.model, 2, 300, kernels=kernels)
    assert all(scales is not None for scales in static._layer_scales)
    fast = generate_grid(fp8_ar.model, ids, grid, t2i, sampling, 5, prefix=prefix, decoder=SlotDecoder(static))
    assert fast.token_ids == eager.token_ids
    torch.testing.assert_close(fast.image_condition, eager.image_condition, rtol=1e-4, atol=1e-5)


@triton_only
@pytest.mark.parametrize("rows", [1, 2, 3, 33])
def test_the_linear_kernel_reads_fp8_weights_with_their_channel_scales(rows):
    """Norm, bias, SwiGLU (gate and up rows with their own scales) and residual folded as with bf16 weights, on the
    dequantized weight; blocks smaller than the weight, so the K loop repeats and its last block is masked (K = 100).
    One and two rows take the dot-free kernel, more the tensor-core one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 100, generator=g)
    w = torch.randn(80, 100, generator=g) * torch.linspace(0.01, 1.0, 80)[:, None]
    q, scale = quantize_weight(w)
    wd = dequantize(q, scale, torch.float32)
    bias, norm_w, residual = torch.randn(80, generator=g), torch.randn(100, generator=g), torch.randn(rows, 80, generator=g)
    blocks = (16, 32, 4, 1)
    got = decode_kernels.linear(x, q, bias=bias, norm=(norm_w, 1e-6), residual=residual, blocks=blocks, scale=scale)
    torch.testing.assert_close(got, residual + F.linear(_rms_norm(x, norm_w, 1e-6), wd, bias), rtol=1e-5, atol=1e-5)
    got = decode_kernels.linear(x, q, swiglu=True, blocks=blocks, scale=scale)
    gate, up = F.linear(x, wd).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@triton_only
@pytest.mark.parametrize("tile", [2, 16])
def test_an_fp8_row_gives_the_same_bits_alone_and_among_others_at_one_tile(tile):
    """Batch invariance with FP8 weights, on the dot-free kernel (tile 2) and the tensor-core one (16).

    The activations are float16, as the GPU's are half precision (bf16). With float32 ones, Triton's interpreter
    hands tl.dot to numpy's matmul and so to the host's OpenBLAS sgemm, whose AVX2 kernels (OpenBLAS's Haswell and
    Zen ones, picked at run time on CPUs without AVX-512) round the last row of a 16-row block differently from the
    first: the row alone (row 0 of its tile) and the same row among 16 (row 15) then differ in the last bit on such
    a host, and only there (OPENBLAS_CORETYPE=Haswell shows it on any x86 CPU), whatever the torch or triton
    version. That is the host library's arithmetic, not the kernel's; float16 dots are numpy's own loop, the same
    for every row."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tile, 96, generator=g).to(torch.float16)
    q, scale = quantize_weight(torch.randn(80, 96, generator=g) * 0.1)
    assert decode_kernels.uses_gemv(q, tile) == (tile < 16)
    together = decode_kernels.linear(x, q, swiglu=True, scale=scale, tile=tile)
    for r in (0, tile - 1):
        assert torch.equal(decode_kernels.linear(x[r:r + 1], q, swiglu=True, scale=scale, tile=tile), together[r:r + 1])


@triton_only
def test_the_dot_free_kernel_reads_every_e4m3_value_exactly():
    """Each of the 254 finite e4m3 bytes, picked out by a one-hot row and scaled by 1, comes back as its exact value
    (which bf16 holds): the widening loses nothing."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = values[~torch.isnan(values.float())]
    w = values.view(2, 127).T.contiguous()  # [127, 2]: every value once
    w = torch.cat([w, torch.zeros(127, 14, dtype=torch.float8_e4m3fn)], dim=1)  # K = 16
    for column in range(2):
        x = torch.zeros(1, 16)
        x[0, column] = 1.0
        got = decode_kernels.linear(x, w, scale=torch.ones(127), tile=2)
        assert decode_kernels.uses_gemv(w, 2)
        assert torch.equal(got[0], w[:, column].float())


@triton_only
def test_the_dot_free_kernel_folds_the_next_norm_from_its_squares():
    """The residual linear's partial sums of squares, then the next linear's RMSNorm from them, on FP8 weights at a
    dot-free tile: as the separate RMSNorm launch, within rounding."""
    g = torch.Generator().manual_seed(4)
    x, residual = torch.randn(2, 96, generator=g), torch.randn(2, 64, generator=g)
    (q1, s1), (q2, s2) = quantize_weight(torch.randn(64, 96, generator=g)), quantize_weight(torch.randn(48, 64, generator=g))
    norm, blocks = (torch.randn(64, generator=g), 1e-6), (8, 32, 4, 1)
    h, squares = decode_kernels.linear(x, q1, residual=residual, emit_squares=True, blocks=blocks, scale=s1)
    assert squares.shape == (2, 8)  # rows of the 2-row tile, programs of 8 columns
    torch.testing.assert_close(h, residual + F.linear(x, dequantize(q1, s1, torch.float32)), rtol=1e-5, atol=1e-5)
    folded = decode_kernels.linear(h, q2, norm=norm, squares=squares, blocks=blocks, scale=s2)
    torch.testing.assert_close(folded, decode_kernels.linear(h, q2, norm=norm, blocks=blocks, scale=s2),
                               rtol=1e-5, atol=1e-5)


@triton_only
def test_bf16_weights_at_a_small_tile_take_the_16_row_tensor_core_kernel():
    """A bf16 (here float16) weight at tile 2 runs exactly the arithmetic it runs at tile 16: a small decoder's
    rows match a 16-slot decoder's bit for bit, as before the dot-free tiles existed."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 96, generator=g).half(), (torch.randn(80, 96, generator=g) * 0.1).half()
    assert not decode_kernels.uses_gemv(w, 2)
    assert torch.equal(decode_kernels.linear(x, w, tile=2), decode_kernels.linear(x, w, tile=16))


@triton_only
def test_the_linear_kernel_refuses_an_fp8_weight_without_its_scales():
    q, scale = quantize_weight(torch.randn(32, 64))
    with pytest.raises(ValueError, match="e4m3 weight needs its float32 scales"):
        decode_kernels.linear(torch.randn(1, 64), q)
    with pytest.raises(ValueError, match="e4m3 weight needs its float32 scales"):
        decode_kernels.linear(torch.randn(1, 64), torch.randn(32, 64), scale=scale)


@triton_only
def test_the_probe_runs_the_fp8_linear_too():
    assert decode_kernels.probe(torch.device("cpu"), torch.float32, fp8=True) is None
    assert decode_kernels.probe(torch.device("cpu"), torch.float32, fp8=True, tile=64) is None
    assert decode_kernels.probe(torch.device("cpu"), torch.float32, fp8=True, tile=2) is None
