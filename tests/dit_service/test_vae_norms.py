"""The VAE's GroupNorm with GPU-wide moments (vae_norms.py): PyTorch's GroupNorm to float32 and bf16 rounding, and a
VAE whose norms are swapped decodes on the CPU exactly as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from torch import nn

from dit_service.model.tiny import TINY_VAE_CONFIG
from dit_service.model.vae_norms import ParallelGroupNorm, group_norm, use_parallel_group_norms


@pytest.mark.parametrize(("shape", "groups", "affine"), [
    ((2, 64, 9, 7), 32, True), ((1, 32, 16, 16), 8, True), ((3, 12, 5), 4, False), ((1, 16, 4, 4, 3), 16, True),
])
def test_group_norm_is_pytorchs_to_float32_rounding(shape, groups, affine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 1.5  # an offset mean: E[x^2] - E[x]^2 must not lose the variance
    weight, bias = (torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)) if affine else (None, None)
    exact = F.group_norm(x.double(), groups, *(None if t is None else t.double() for t in (weight, bias)), 1e-6)
    ours = group_norm(x, groups, weight, bias, 1e-6)
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    assert (ours.double() - exact).abs().max() < 1e-5
    # In bf16 the result is rounded once, as PyTorch's kernel rounds it.
    bf16 = group_norm(x.bfloat16(), groups, weight, bias, 1e-6)
    pytorch = F.group_norm(x.bfloat16(), groups, *(None if t is None else t.bfloat16() for t in (weight, bias)), 1e-6)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.double() - exact).abs().max() <= 1.5 * (pytorch.double() - exact).abs().max() + 1e-3


def test_a_vae_with_swapped_norms_decodes_on_the_cpu_as_before():
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(dict(TINY_VAE_CONFIG)).eval()
    latents = torch.randn(1, vae.config.latent_channels, 8, 8)
    with torch.no_grad():
        before = vae.decode(latents).sample
    state = {k: v.clone() for k, v in vae.state_dict().items()}
    swapped = use_parallel_group_norms(vae)
    assert swapped == sum(isinstance(m, nn.GroupNorm) for m in vae.modules()) > 0
    assert all(type(m) is ParallelGroupNorm for m in vae.modules() if isinstance(m, nn.GroupNorm))
    assert all(torch.equal(state[k], v) for k, v in vae.state_dict().items())
    with torch.no_grad():
        assert torch.equal(vae.decode(latents).sample, before)  # the CPU keeps PyTorch's kernel
    assert use_parallel_group_norms(vae) == 0  # already swapped
