"""The answered size -> rendered size rule (ar_service.prompt.upscale_for), torch-free."""

from __future__ import annotations

import pytest

from ar_service.prompt import upscale_for

# The shapes model's numbers: size multiple 16, draws at most 256, best at its 128x128 default, enlarges up to 8x.
SHAPES = dict(multiple=16, max_side=256, max_upscale=8, render_side=128)


@pytest.mark.parametrize(
    ("width", "height", "factor"),
    [
        (128, 128, 1), (256, 256, 1), (256, 64, 1), (16, 16, 1),  # drawn as asked
        (512, 512, 4), (1024, 1024, 8), (384, 384, 3), (1024, 512, 8), (512, 256, 4),  # enlarged from <= 128
        (1792, 1024, None), (2048, 2048, None),  # 14x / 16x: more than 8
        (520, 520, None), (100, 100, None), (0, 0, None),  # no factor gives whole multiples of 16
    ],
)
def test_shapes_model_sizes(width, height, factor):
    assert upscale_for(width, height, **SHAPES) == factor


def test_the_rendered_size_is_a_whole_multiple_no_larger_than_the_default():
    for side in range(16, 1100, 16):
        factor = upscale_for(side, side, **SHAPES)
        if factor is None or factor == 1:
            continue
        assert side % factor == 0 and (side // factor) % 16 == 0 and side // factor <= 128


def test_no_enlargement_unless_the_checkpoint_allows_it():
    assert upscale_for(512, 512, multiple=16, max_side=256, max_upscale=1, render_side=128) is None
    assert upscale_for(512, 512, multiple=16, max_side=512, max_upscale=1, render_side=256) == 1


def test_render_side_never_exceeds_max_side():
    # a default larger than max_side (a misconfiguration) still renders within max_side
    assert upscale_for(600, 600, multiple=16, max_side=100, max_upscale=8, render_side=400) is None
    assert upscale_for(192, 192, multiple=16, max_side=96, max_upscale=8, render_side=400) == 2
