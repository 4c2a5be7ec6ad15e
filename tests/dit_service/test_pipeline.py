import numpy as np
import pytest
import torch

from dit_service.imaging import encode_image


def _render(pipeline, text, image, uncond, seed=0, width=64, height=64, steps=2, guidance=4.0, cfg_mode="sequential"):
    result = pipeline.render_latents(
        text_condition=text, image_condition=image, uncond_condition=uncond, width=width, height=height,
        seed=seed, steps=steps, guidance=guidance, cfg_range=(0.0, 1.0), cfg_mode=cfg_mode,
    )
    return result.latents, pipeline.decode(result.latents)


def test_geometry(pipeline):
    assert pipeline.condition_dim == 64
    assert (pipeline.latent_channels, pipeline.vae_scale_factor, pipeline.patch_size) == (16, 8, 2)
    assert pipeline.size_multiple == 16
    assert pipeline.latent_shape(width=512, height=256) == (16, 32, 64)
    with pytest.raises(ValueError):
        pipeline.latent_shape(width=250, height=256)


def test_same_seed_identical_different_seed_different(pipeline, text, image, empty):
    latents_a, pixels_a = _render(pipeline, text, image, empty, seed=7)
    latents_b, pixels_b = _render(pipeline, text, image, empty, seed=7)
    assert torch.equal(latents_a, latents_b)
    assert encode_image(pixels_a, "png", None) == encode_image(pixels_b, "png", None)
    _, other_seed = _render(pipeline, text, image, empty, seed=8)
    assert np.abs(pixels_a.astype(int) - other_seed.astype(int)).mean() > 1.0


def test_condition_changes_the_image(pipeline, text, image, empty):
    _, base = _render(pipeline, text, image, empty, seed=1)
    _, other = _render(pipeline, text, image.flip(0) * 3, empty, seed=1)
    assert not np.array_equal(base, other)


def test_empty_condition_renders(pipeline, empty):
    latents, pixels = _render(pipeline, empty, empty, empty, steps=2)
    assert torch.isfinite(latents).all() and pixels.shape == (64, 64, 3)


def test_packed_mode_gives_the_same_png(pipeline, text, image, empty):
    _, seq = _render(pipeline, text, image, empty, seed=3, cfg_mode="sequential")
    _, packed = _render(pipeline, text, image, empty, seed=3, cfg_mode="packed")
    assert np.array_equal(seq, packed)


def test_decode_sizes(pipeline, text, image, empty):
    latents, pixels = _render(pipeline, text, image, empty, width=256, height=256, steps=1)
    assert latents.shape == (1, 16, 32, 32) and pixels.shape == (256, 256, 3) and pixels.dtype == np.uint8
    latents, pixels = _render(pipeline, text, image, empty, width=512, height=256, steps=1)
    assert latents.shape == (1, 16, 32, 64) and pixels.shape == (256, 512, 3)


def test_rejects_wrong_condition_width(pipeline, empty):
    with pytest.raises(ValueError, match="text_condition"):
        _render(pipeline, torch.zeros(3, 32), empty, empty)


def test_condition_mode_selects_what_the_dit_sees(pipeline, text, image):
    both = pipeline.assemble_condition(text, image)
    assert torch.equal(both, torch.cat([text, image]))
    try:
        pipeline.condition_mode = "image"
        assert torch.equal(pipeline.assemble_condition(text, image), image)
        pipeline.condition_mode = "text"
        assert torch.equal(pipeline.assemble_condition(text, image), text)
    finally:
        pipeline.condition_mode = "text_image"


def test_refiner_maps_image_condition_to_queries(refiner_pipeline, text, image, empty):
    refiner = refiner_pipeline.refiner
    assert refiner.num_queries == 16
    out = refiner(image[None])
    assert out.shape == (1, 16, 64) and torch.isfinite(out).all()
    condition = refiner_pipeline.assemble_condition(text, image)
    assert condition.shape == (text.shape[0] + 16, 64)  # [text | 16 queries]
    assert torch.equal(condition[: text.shape[0]], text)
    # padding keys are ignored: a padded batch gives the unpadded result
    padded = torch.cat([image, torch.full((4, 64), 9.0)])[None]
    mask = torch.zeros(1, padded.shape[1], dtype=torch.bool)
    mask[0, image.shape[0]:] = True
    torch.testing.assert_close(refiner(padded, mask), out)
    # an empty image condition skips the refiner
    assert refiner_pipeline.assemble_condition(text, empty).shape == text.shape
    latents, _ = _render(refiner_pipeline, text, image, empty, steps=1)
    assert torch.isfinite(latents).all()


def test_missing_config_is_a_plain_error(tmp_path):
    from servicekit.checkpoint import open_checkpoint

    with pytest.raises(FileNotFoundError, match="config.json"):
        open_checkpoint(tmp_path)


def test_cuda_graphs_leave_the_cpu_path_eager_and_its_images_unchanged(pipeline, text, image, empty):
    before = pipeline.render_latents(text, image, empty, 64, 64, seed=3, steps=3, guidance=2.0).latents
    pipeline.use_cuda_graphs(8)
    try:
        assert pipeline.step_model is pipeline.transformer  # graphs are a CUDA feature; the CPU stays bit-exact
        after = pipeline.render_latents(text, image, empty, 64, 64, seed=3, steps=3, guidance=2.0).latents
    finally:
        pipeline.step_model = pipeline.transformer
    assert torch.equal(before, after)


def test_warm_up_leaves_no_trace_in_later_images(pipeline, text, image, empty):
    before = pipeline.render_latents(text, image, empty, 64, 64, seed=5, steps=2, guidance=3.0).latents
    assert pipeline.warm_up() > 0
    after = pipeline.render_latents(text, image, empty, 64, 64, seed=5, steps=2, guidance=3.0).latents
    assert torch.equal(before, after)
