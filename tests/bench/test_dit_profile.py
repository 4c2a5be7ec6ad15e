"""bench.dit_profile's parts that say what a profile means: the kernel kinds its sums go by, and the shapes and rows
it times the block linears at (the timing itself needs a GPU)."""

from __future__ import annotations

import torch

from bench.dit_profile import DiTBench, kind_of, linear_rows, linear_shapes


def test_kernels_are_summed_under_the_kind_that_names_their_work():
    """Names as an H200 profile of a denoise step shows them."""
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128") == "attention"
    assert kind_of("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "matmul"
    assert kind_of("_quantize_rows_kernel") == "fp8 quantizer"
    assert kind_of("triton_poi_fused__to_copy_mul_silu_0") == "compiled elementwise"
    assert kind_of("void at::native::vectorized_gather_kernel<16, long>") == "other"


def test_the_block_linears_are_timed_at_the_rows_and_shapes_a_step_multiplies():
    bench = DiTBench(True, torch.device("cpu"), torch.float32)
    block = bench.pipeline.transformer.layers[0]
    shapes = linear_shapes(bench)
    assert shapes["q"] == tuple(block.attn.to_q.weight.shape)
    assert shapes["qkv (fused)"][0] == sum(shapes[r][0] for r in ("q", "k", "v"))
    assert shapes["gate/up (fused)"] == (2 * shapes["gate"][0], shapes["gate"][1])
    assert shapes["down"] == tuple(block.feed_forward.linear_2.weight.shape)
    # a guided step packs the conditional row (image tokens + condition) and the unconditional one (image tokens)
    rows = linear_rows(bench, 64)
    image_tokens = (64 // 8 // 2) ** 2
    assert rows > 2 * image_tokens
