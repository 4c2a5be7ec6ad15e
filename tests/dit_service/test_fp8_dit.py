"""FP8 matmuls in the DiT (``DiTPipeline.quantize("fp8")``): which linears, and a denoise that stays near bf16's.

On the CPU ``servicekit.fp8.scaled_mm`` computes the row-scaled product in float32 (the reference of what
``torch._scaled_mm`` does on the GPU); the Triton kernels the GPU path takes run here in Triton's interpreter; the
speed and the CUDA graphs are bench/fp8_check.py's and bench/dit_profile.py's to measure on an H200.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dit_service.model.pipeline import DiTPipeline
from dit_service.model.transformer import BLOCK_FP8_LINEARS
from servicekit.checkpoint import open_checkpoint
from servicekit.fp8 import FP8Linear


@pytest.fixture(scope="module")
def fp8_pipeline(tiny_root):
    pipeline = DiTPipeline.from_checkpoint(open_checkpoint(tiny_root))
    pipeline.quantize("fp8")
    return pipeline


def test_the_blocks_linears_are_fp8_and_the_small_layers_are_not(fp8_pipeline):
    dit = fp8_pipeline.transformer
    blocks = [*dit.context_refiner, *dit.noise_refiner, *dit.ref_image_refiner, *dit.layers]
    for block in blocks:
        assert all(isinstance(block.get_submodule(name), FP8Linear) for name in BLOCK_FP8_LINEARS)
    kept = [dit.x_embedder, dit.time_caption_embed.caption_embedder[1], dit.norm_out.linear_1, dit.norm_out.linear_2,
            dit.layers[0].norm1.linear]
    assert all(type(m) is nn.Linear for m in kept)
    assert sum(isinstance(m, FP8Linear) for m in dit.modules()) == len(blocks) * len(BLOCK_FP8_LINEARS)


def test_unknown_quantization_is_refused(pipeline):
    with pytest.raises(ValueError, match="quantization must be 'none' or 'fp8'; got 'int8'"):
        pipeline.quantize("int8")


def test_an_fp8_velocity_and_a_guided_denoise_stay_near_the_unquantized_ones(fp8_pipeline, pipeline, text, image, empty):
    """Same inputs, same seed: FP8's velocity differs from the float32 model's by a few percent (e4m3 keeps three
    mantissa bits), and a packed CFG batch of different condition lengths still gives each sample its own result."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=g)
    t = torch.tensor([0.3, 0.7])
    cond = torch.randn(2, 17, text.shape[1], generator=g)
    with torch.no_grad():
        got = fp8_pipeline.transformer(x, t, cond, [17, 9])
        ref = pipeline.transformer(x, t, cond, [17, 9])
        alone = fp8_pipeline.transformer(x[1:], t[1:], cond[1:, :9])
    error = float((got - ref).norm() / ref.norm())
    assert 0 < error < 0.1
    torch.testing.assert_close(got[1:], alone, rtol=1e-5, atol=1e-5)
    a = fp8_pipeline.render_latents(text, image, empty, 64, 64, seed=3, steps=3, guidance=4.0).latents
    b = pipeline.render_latents(text, image, empty, 64, 64, seed=3, steps=3, guidance=4.0).latents
    assert float((a - b).norm() / b.norm()) < 0.1


@torch.no_grad()
def test_the_cuda_kernels_give_the_torch_paths_velocity_bit_for_bit(tiny_root, text, monkeypatch):
    """On CUDA a bf16 FP8 DiT quantizes its activations, runs the SwiGLU into the down projection's quantizer and
    normalises and rotates q/k in Triton kernels. The same kernels, run in Triton's interpreter on this bf16 model,
    give the torch path's velocity bit for bit: packed CFG rows of different condition lengths, GQA, the refiners."""
    from dit_service.model import qk_rope_kernel
    from servicekit import fp8_kernels

    model = DiTPipeline.from_checkpoint(open_checkpoint(tiny_root), dtype=torch.bfloat16)
    model.quantize("fp8")
    dit = model.transformer
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, 8, 8, generator=g).to(torch.bfloat16)
    t = torch.tensor([0.3, 0.7], dtype=torch.bfloat16)
    cond = torch.randn(2, 17, text.shape[1], generator=g).to(torch.bfloat16)
    torch_path = dit(x, t, cond, [17, 9])
    calls = {"quantize": 0, "swiglu": 0, "qk": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(fp8_kernels, "supports", lambda tensor: True)
    monkeypatch.setattr(qk_rope_kernel, "supports", lambda tensor: tensor.dtype == torch.bfloat16)
    monkeypatch.setattr(fp8_kernels, "triton_quantize_rows", counted("quantize", fp8_kernels.triton_quantize_rows))
    monkeypatch.setattr(fp8_kernels, "triton_swiglu_quantize_rows",
                        counted("swiglu", fp8_kernels.triton_swiglu_quantize_rows))
    monkeypatch.setattr(qk_rope_kernel, "qk_norm_rope", counted("qk", qk_rope_kernel.qk_norm_rope))
    kernel_path = dit(x, t, cond, [17, 9])
    blocks = len(dit.context_refiner) + len(dit.noise_refiner) + len(dit.layers)
    assert calls == {"quantize": 3 * blocks, "swiglu": blocks, "qk": 2 * blocks}
    assert torch.equal(kernel_path, torch_path)
