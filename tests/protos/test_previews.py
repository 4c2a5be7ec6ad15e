"""Which denoising steps the partial images come after: evenly spaced, never the last, never twice."""

from __future__ import annotations

import pytest

from protos.previews import MAX_PARTIAL_IMAGES, preview_steps


def test_previews_split_the_denoise_into_equal_parts():
    assert preview_steps(50, 3) == [12, 25, 37]
    assert preview_steps(8, 3) == [2, 4, 6]
    assert preview_steps(20, 1) == [10]
    assert preview_steps(9, 2) == [3, 6]


@pytest.mark.parametrize("steps", range(1, 60))
@pytest.mark.parametrize("count", range(0, MAX_PARTIAL_IMAGES + 1))
def test_an_image_gets_min_of_count_and_steps_minus_one_distinct_previews_before_its_last_step(steps, count):
    chosen = preview_steps(steps, count)
    assert len(chosen) == min(count, steps - 1)
    assert chosen == sorted(set(chosen))
    assert all(1 <= step < steps for step in chosen)
