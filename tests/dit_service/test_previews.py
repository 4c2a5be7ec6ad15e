"""Partial images: the latent-to-RGB map fitted to the VAE, the data estimate it is applied to, and the engine's
previews (which steps, what they look like, and that they leave the final image alone)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from PIL import Image

from dit_service.engine import DiTEngine, FinishedImage, PreviewImage, Progress, RenderDone, RenderFailed
from dit_service.model.preview import LatentPreviewer, synthetic_pictures
from dit_service.model.sampler import initial_noise, start_entry, step_entries
from dit_service.model.tiny import TINY_VAE_CONFIG
from protos.knobs import FAMILIES
from protos.status import RequestRejected

HIDDEN = 64


def held_out_error(previewer: LatentPreviewer, vae, count: int = 4) -> tuple[float, float]:
    """(mean squared error of the previews' block colours, that of the best constant colour) on pictures the fit
    never saw."""
    pictures = synthetic_pictures(count, 128, seed=123)
    config = vae.config
    latents = (vae.encode(pictures).latent_dist.mean - config.shift_factor) * config.scaling_factor
    predicted = torch.stack([previewer.rgb(latents[i : i + 1]) for i in range(count)])
    target = F.avg_pool2d(pictures, previewer.scale_factor)
    constant = target.mean(dim=(0, 2, 3), keepdim=True)
    return float(((predicted - target) ** 2).mean()), float(((constant - target) ** 2).mean())


@torch.no_grad()
def test_the_fitted_map_tells_colours_apart_on_pictures_it_never_saw(pipeline):
    error, baseline = held_out_error(pipeline.previewer, pipeline.vae)
    assert error < 0.8 * baseline, (error, baseline)


@torch.no_grad()
def test_the_map_fits_any_latent_channel_count_and_is_the_same_every_time():
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config({**TINY_VAE_CONFIG, "latent_channels": 4}).eval()
    previewer = LatentPreviewer.fit(vae, "cpu", torch.float32)
    assert previewer.weight.shape == (3, 4)
    again = LatentPreviewer.fit(vae, "cpu", torch.float32)
    assert torch.equal(previewer.weight, again.weight) and torch.equal(previewer.bias, again.bias)
    pixels = previewer.pixels(torch.randn(1, 4, 6, 10))
    assert pixels.shape == (48, 80, 3) and pixels.dtype.name == "uint8"


@torch.no_grad()
def test_a_vae_that_computes_non_finite_latents_is_named_as_the_cause():
    """On a device where the VAE's kernels go wrong (seen under CUDA MPS with a client held to 40% of the SMs) the
    fit says so, instead of LAPACK's "Argument 4 has illegal value"."""
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config({**TINY_VAE_CONFIG, "latent_channels": 4}).eval()
    vae.encoder.conv_in.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="VAE's encoder gave non-finite latents for the preview fit on cpu"):
        LatentPreviewer.fit(vae, "cpu", torch.float32)


def test_a_model_that_knows_the_velocity_previews_the_final_image_at_every_step():
    shape, seed = (16, 4, 4), 7
    data = torch.randn(1, *shape, generator=torch.Generator().manual_seed(1))
    velocity = data - initial_noise(shape, seed)  # the straight path's velocity, the same at every t

    def transformer(x, t, cond, lengths):
        return velocity.expand(x.shape[0], *shape)

    entry = start_entry(torch.zeros(1, HIDDEN), torch.zeros(0, HIDDEN), shape, seed, steps=5, guidance=1.0)
    while not entry.done:
        step_entries(transformer, [entry])
        torch.testing.assert_close(entry.predicted_data(), data, rtol=0, atol=1e-5)


def make_engine(pipeline) -> DiTEngine:
    return DiTEngine(pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096, max_batch_size=4)


def render(engine, partial_images, steps=8, n=1, output_format="png", width=64, height=32):
    g = torch.Generator().manual_seed(0)
    condition = torch.randn(10, HIDDEN, generator=g)
    plan = engine.plan(request_id="r", width=width, height=height, n=n, seed=3, output_format=output_format,
                       output_compression=None, knobs={"num_inference_steps": steps, "text_guidance_scale": 4.0},
                       hidden_size=HIDDEN, dtype="float32", text_positions=4, image_positions=6, negative_positions=0,
                       partial_images=partial_images)
    job = engine.submit(plan, condition, torch.zeros(0, HIDDEN))
    events = []
    while True:
        event = job.events.get(timeout=60)
        if isinstance(event, RenderFailed):
            raise event.error
        events.append(event)
        if isinstance(event, RenderDone):
            return events


def test_previews_come_evenly_spaced_before_each_image_and_leave_it_unchanged(pipeline):
    engine = make_engine(pipeline)
    try:
        plain = render(engine, partial_images=0, n=2)
        previewed = render(engine, partial_images=3, n=2)
    finally:
        engine.close()
    assert not any(isinstance(e, PreviewImage) for e in plain)
    for index in (0, 1):
        previews = [e for e in previewed if isinstance(e, PreviewImage) and e.index == index]
        assert [(p.partial_index, p.step, p.total) for p in previews] == [(0, 2, 8), (1, 4, 8), (2, 6, 8)]
        for preview in previews:
            picture = Image.open(io.BytesIO(preview.data))
            assert picture.format == "PNG" and picture.size == (64, 32) and (preview.width, preview.height) == (64, 32)
        # each preview follows its step's progress event and precedes the image
        mine = [e for e in previewed if getattr(e, "index", None) == index]
        for preview in previews:
            before = mine[mine.index(preview) - 1]
            assert isinstance(before, Progress) and before.step == preview.step
        assert isinstance(mine[-1], FinishedImage)
    finals = lambda events: {e.index: e.data for e in events if isinstance(e, FinishedImage)}  # noqa: E731
    assert finals(previewed) == finals(plain)
    assert previewed[-1].timings["preview_ms"] > 0 and plain[-1].timings["preview_ms"] == 0


def test_previews_take_the_requested_format(pipeline):
    engine = make_engine(pipeline)
    try:
        events = render(engine, partial_images=1, steps=2, output_format="jpeg")
    finally:
        engine.close()
    (preview,) = [e for e in events if isinstance(e, PreviewImage)]
    assert preview.step == 1 and Image.open(io.BytesIO(preview.data)).format == "JPEG"


@pytest.mark.parametrize("count", [-1, 4])
def test_partial_images_outside_0_to_3_is_refused_naming_it(pipeline, count):
    engine = make_engine(pipeline)
    try:
        with pytest.raises(RequestRejected) as caught:
            render(engine, partial_images=count)
    finally:
        engine.close()
    assert caught.value.param == "partial_images"
