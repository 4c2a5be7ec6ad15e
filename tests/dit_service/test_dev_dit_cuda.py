"""The MammothModa2-Dev DiT layout's speed modes on a GPU: CUDA graphs, FP8 with the CUDA kernels, packed rows and
step caching take the Dev context (the Q-Former's tokens after the captioned text) as they take Preview's condition.

Skipped without CUDA (CI); run on a GPU machine with ``TRITON_INTERPRET=0`` (tests/conftest.py otherwise runs Triton
in its interpreter). Imports the model side only, so it runs where the services' transport packages are absent.
"""

from __future__ import annotations

import pytest
import torch

from dit_service.model.pipeline import DiTPipeline
from servicekit.checkpoint import open_checkpoint
from tests.dit_service.conftest import DEV_CONDITION_DIM


def _rows(n, seed):
    return torch.randn(n, DEV_CONDITION_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the CUDA kernels need a GPU")
@torch.no_grad()
def test_cuda_speed_modes_take_the_dev_context(dev_root):
    """On a GPU in bf16: CUDA graphs replay the eager step bit for bit, FP8 stays near bf16, packed rows and step
    caching run on the Dev context."""
    text, image, negative = _rows(5, 1), _rows(11, 2), _rows(7, 3)
    pipeline = DiTPipeline.from_checkpoint(open_checkpoint(dev_root), device="cuda", dtype=torch.bfloat16)
    assert pipeline.transformer.pack_samples

    def render(p, cache=0.0, seed=3):
        entries = [p.start_entry(text, image, negative, 64, 64, seed=seed, steps=8, guidance=4.0, cache_threshold=cache),
                   p.start_entry(_rows(9, 5), image, negative[:2], 64, 64, seed=seed + 1, steps=8, guidance=4.0,
                                 cache_threshold=cache)]
        while not entries[0].done:
            p.step(entries)
        return entries

    eager = render(pipeline)
    pipeline.use_cuda_graphs(8)
    graphed = [render(pipeline) for _ in range(3)]  # eager, captured, replayed
    assert pipeline.step_model.counts["replayed"] > 0, pipeline.step_model.counts
    for run in graphed:
        assert all(torch.equal(a.latents, b.latents) for a, b in zip(eager, run, strict=True))
    cached = render(pipeline, cache=0.5)
    assert cached[0].skipped_steps > 0 and torch.isfinite(cached[0].latents).all()
    fp8 = DiTPipeline.from_checkpoint(open_checkpoint(dev_root), device="cuda", dtype=torch.bfloat16)
    fp8.quantize("fp8")
    fp8.use_cuda_graphs(8)
    quantized = [render(fp8) for _ in range(3)][-1]
    for a, b in zip(quantized, eager, strict=True):
        assert float((a.latents - b.latents).float().norm() / b.latents.float().norm()) < 0.15
