"""dit_service.imaging.enlarge and the checkpoint setting that allows it (ServingDefaults.max_upscale)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from dit_service.engine import DiTEngine, FinishedImage
from dit_service.imaging import enlarge
from dit_service.planning import MAX_ANSWERED_PIXELS
from protos.knobs import FAMILIES
from protos.status import RequestRejected
from servicekit.checkpoint import MAX_UPSCALE, SERVING_FILE, ServingDefaults, _read_serving


def test_enlarge_gives_the_stated_size_and_keeps_flat_colours():
    pixels = np.zeros((16, 24, 3), np.uint8)
    pixels[:, :12] = (200, 30, 30)
    pixels[:, 12:] = (30, 30, 200)
    big = enlarge(pixels, 4)
    assert big.shape == (64, 96, 3) and big.dtype == np.uint8
    # Lanczos reaches 3 source pixels (12 here) either side of an edge; beyond, the colours are exact
    assert (big[:, :32] == (200, 30, 30)).all() and (big[:, 64:] == (30, 30, 200)).all()


def test_factor_one_is_the_same_pixels_and_bad_factors_are_refused():
    pixels = np.full((8, 8, 3), 7, np.uint8)
    assert enlarge(pixels, 1) is pixels
    with pytest.raises(ValueError, match="factor"):
        enlarge(pixels, 0)


def test_max_upscale_bounds():
    assert ServingDefaults().max_upscale == 1
    assert ServingDefaults(max_upscale=MAX_UPSCALE).max_upscale == MAX_UPSCALE
    for bad in (0, MAX_UPSCALE + 1):
        with pytest.raises(ValueError, match="max_upscale"):
            ServingDefaults(max_upscale=bad)


def test_max_upscale_read_from_ardit_serving_json(tmp_path):
    (tmp_path / SERVING_FILE).write_text(json.dumps({"max_upscale": 8}))
    assert _read_serving(tmp_path).max_upscale == 8
    (tmp_path / SERVING_FILE).write_text(json.dumps({"max_upscale": "8"}))
    with pytest.raises(ValueError, match="max_upscale must be an integer"):
        _read_serving(tmp_path)


def test_the_committed_shapes_checkpoint_enlarges_up_to_8():
    from tools.local_stack import ROOT
    from train.architecture import SERVING

    assert _read_serving(ROOT / "train" / "checkpoints" / "shapes") == SERVING
    assert SERVING.max_upscale == 8


def test_the_engine_sends_pictures_at_the_enlarged_size_and_refuses_too_much(pipeline):
    """dit_service's engine on the tiny pipeline: an upscale-3 render of 32x16 is sent as a 96x48 PNG."""
    engine = DiTEngine(pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096)
    hidden = pipeline.condition_dim
    header = dict(request_id="r", n=1, seed=1, output_format="png", output_compression=None,
                  knobs={"num_inference_steps": 2}, hidden_size=hidden, dtype="float32", text_positions=4,
                  image_positions=0, negative_positions=0)
    try:
        plan = engine.plan(width=32, height=16, upscale=3, **header)
        assert plan.answered_size == (96, 48)
        job = engine.submit(plan, torch.randn(4, hidden), torch.zeros(0, hidden))
        images = []
        while not images:
            event = job.events.get(timeout=120)
            if isinstance(event, FinishedImage):
                images.append(event)
        assert (images[0].width, images[0].height) == (96, 48)
        assert Image.open(io.BytesIO(images[0].data)).size == (96, 48)
        for bad in (0, 17):
            with pytest.raises(RequestRejected, match="upscale"):
                engine.plan(width=32, height=16, upscale=bad, **header)
        side = 1024  # 1024 * 16 = 16384 per side: more than MAX_ANSWERED_PIXELS
        assert (side * 16) ** 2 > MAX_ANSWERED_PIXELS
        with pytest.raises(RequestRejected, match="pixels per picture"):
            engine.plan(width=side, height=side, upscale=16, **header)
    finally:
        engine.close()
