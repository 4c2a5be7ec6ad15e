"""dit_service.imaging.enlarge and the checkpoint setting that allows it (ServingDefaults.max_upscale)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dit_service.imaging import enlarge
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
