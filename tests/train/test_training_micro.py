"""The training code path end to end at micro scale on the CPU: three stages, the checkpoint through the tiny
model's save path, and the services' own loaders reading it back."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from ar_service.conditions import prompt_ids_for
from ar_service.generation import generate_grid
from ar_service.model.loading import load_ar
from ar_service.sampling import SamplingParams
from dit_service.model.pipeline import DiTPipeline
from servicekit.checkpoint import open_checkpoint
from train import architecture, report
from train.cli import parser, run
from train.shapes import Scene, shape_mask
from train.stages import EMA, grid, shape_loss_weights


def test_micro_training_writes_a_checkpoint_the_services_load(tmp_path):
    out = tmp_path / "model"
    args = parser("test", with_stages=False).parse_args(
        ["--out", str(out), "--device", "cpu", "--scale", "micro", "--dit-batch", "3",
         "--dit-shape-weight", "4"])
    record = run(args, ["vae", "ar", "dit"])

    assert [s["stage"] for s in record["stages"]] == ["vae", "ar", "dit"]
    assert all(s["steps"] >= 1 and s["losses"] for s in record["stages"])
    assert record["stages"][2]["data"]["batch"] == 3  # --dit-batch over the scale's 4
    assert record["stages"][2]["data"]["shape_weight"] == 4
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 6 and (out / "model.safetensors").stat().st_size < 16 * 2**20, files
    log = json.loads((tmp_path / report.LOG_NAME).read_text())
    assert log["runs"][-1]["seed"] == 0 and (tmp_path / report.PLOT_NAME).is_file()
    assert [c["scrambled"] for c in log["runs"][-1]["held_out_check"]] == [False, True]

    checkpoint = open_checkpoint(out)
    vae_config = checkpoint.config["gen_vae_config"]
    assert abs(vae_config["shift_factor"] - record["stages"][0]["data"]["latent_shift"]) < 1e-4  # the trained statistics
    assert checkpoint.serving == architecture.SERVING

    loaded = load_ar(out)
    assert not loaded.t2i.do_sample  # greedy by default
    g = grid()
    result = generate_grid(loaded.model, prompt_ids_for(loaded.tokenizer, "a small red circle on the left, blue background", g),
                           g, loaded.t2i, SamplingParams(temperature=0.0), seed=0)
    pipeline = DiTPipeline.from_checkpoint(checkpoint)
    empty = torch.zeros(0, loaded.config.hidden_size)
    latents = pipeline.render_latents(result.text_condition, result.image_condition, empty, 128, 128, 0, 2, 1.0).latents
    assert pipeline.decode(latents).shape == (128, 128, 3)


def test_dit_loss_weights_the_latents_the_shape_touches():
    small = Scene("square", "red", "centre", "small", "blue")
    large = Scene("square", "red", "centre", "large", "blue")
    weights = shape_loss_weights([small, large], (16, 16), 4.0, "cpu")
    assert weights.shape == (2, 1, 16, 16) and set(weights.unique().tolist()) == {1.0, 5.0}
    touched = weights[:, 0] > 1
    assert not touched[:, 0].any() and not touched[:, :, 0].any()  # the border is background
    assert touched[0].sum() < touched[1].sum()  # a small shape touches fewer latents
    rows, cols = torch.nonzero(touched[0], as_tuple=True)
    mask = shape_mask(small)  # the touched latents are exactly those whose 8x8 pixels hold some of the shape
    assert rows.min() * 8 <= mask.any(axis=1).nonzero()[0].min() < (rows.min() + 1) * 8
    assert (cols.max() + 1) * 8 > mask.any(axis=0).nonzero()[0].max() >= cols.max() * 8
    assert (shape_loss_weights([small], (16, 16), 0.0, "cpu") == 1).all()  # weight 0: the uniform loss


def test_loss_curves_join_continued_runs_and_mark_the_weighted_loss(tmp_path):
    first = {"stage": "dit", "steps": 300, "data": {}, "losses": [[200, 0.5], [300, 0.4]]}
    second = {"stage": "dit", "steps": 400, "data": {"shape_weight": 4.0}, "losses": [[200, 0.6], [400, 0.55]]}
    fresh = {"stage": "vae", "steps": 10, "data": {}, "losses": [[10, 0.1]]}
    log = {"runs": [{"stages": [first]}, {"continued": True, "stages": [second]}, {"stages": [fresh]}]}
    segments = report.stage_segments(log)
    assert segments["dit"] == [(False, 0, 300, [[200, 0.5], [300, 0.4]]),
                               (True, 300, 400, [[500, 0.6], [700, 0.55]])]  # steps go on from the first run
    assert segments["vae"] == [(False, 0, 10, [[10, 0.1]])]
    report.plot(log, tmp_path / "curves.png")
    pixels = set(map(tuple, np.asarray(Image.open(tmp_path / "curves.png").convert("RGB")).reshape(-1, 3).tolist()))
    assert report.WEIGHTED_LOSS in pixels and report.UNIFORM_LOSS in pixels


def test_ema_keeps_the_decayed_average_the_dit_stage_saves():
    """Two updates with decay 0.9: each shadow moves a tenth of the way to its parameter; copy_to_module writes it."""
    layer = torch.nn.Linear(3, 2)
    start = {n: p.detach().clone() for n, p in layer.named_parameters()}
    ema = EMA(layer, decay=0.9)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)
    ema.update()
    ema.update()
    ema.copy_to_module()
    for n, p in layer.named_parameters():
        # shadow after two updates toward start + 1: start + (1 - 0.9 ** 2)
        torch.testing.assert_close(p.detach(), start[n] + 0.19)
