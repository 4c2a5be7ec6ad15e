import numpy as np
import pytest
import torch

from dit_service.imaging import encode_image


def _render(pipeline, condition, uncond, seed=0, width=64, height=64, steps=2, guidance=4.0):
    result = pipeline.render_latents(
        condition=condition, uncond_condition=uncond, width=width, height=height,
        seed=seed, steps=steps, guidance=guidance, cfg_range=(0.0, 1.0),
    )
    return result.latents, pipeline.decode(result.latents)


def test_geometry(pipeline):
    assert pipeline.condition_dim == 64
    assert (pipeline.latent_channels, pipeline.vae_scale_factor, pipeline.patch_size) == (16, 8, 2)
    assert pipeline.size_multiple == 16
    assert pipeline.latent_shape(width=512, height=256) == (16, 32, 64)
    with pytest.raises(ValueError):
        pipeline.latent_shape(width=250, height=256)


def test_same_seed_gives_identical_latents_and_png(pipeline, condition, empty_condition):
    latents_a, pixels_a = _render(pipeline, condition, empty_condition, seed=7)
    latents_b, pixels_b = _render(pipeline, condition, empty_condition, seed=7)
    assert torch.equal(latents_a, latents_b)
    assert encode_image(pixels_a, "png", None) == encode_image(pixels_b, "png", None)


def test_different_seed_or_condition_gives_different_image(pipeline, condition, empty_condition):
    _, base = _render(pipeline, condition, empty_condition, seed=1)
    _, other_seed = _render(pipeline, condition, empty_condition, seed=2)
    _, other_cond = _render(pipeline, condition.flip(0) * 3, empty_condition, seed=1)
    assert np.abs(base.astype(int) - other_seed.astype(int)).mean() > 1.0
    assert not np.array_equal(base, other_cond)


def test_decode_256_square(pipeline, condition, empty_condition):
    latents, pixels = _render(pipeline, condition, empty_condition, width=256, height=256, steps=2)
    assert latents.shape == (1, 16, 32, 32)
    assert pixels.shape == (256, 256, 3) and pixels.dtype == np.uint8


def test_decode_keeps_aspect_width_512_height_256(pipeline, condition, empty_condition):
    latents, pixels = _render(pipeline, condition, empty_condition, width=512, height=256, steps=1)
    assert latents.shape == (1, 16, 32, 64)
    assert pixels.shape == (256, 512, 3)


def test_rejects_wrong_condition_width(pipeline, empty_condition):
    with pytest.raises(ValueError):
        _render(pipeline, torch.zeros(3, 32), empty_condition)


def test_missing_directory_is_a_plain_error(tmp_path):
    from dit_service.model.pipeline import DiTPipeline

    with pytest.raises(FileNotFoundError, match="dit/config.json"):
        DiTPipeline.from_directory(tmp_path)
