"""Which visual-token grid a size gets (ardit_serving.json ``grid_rule``): by default the released MammothModa2 grid,
about 1,024 tokens at the image's aspect ratio (32x32 for every square size); ``pixels_per_token`` is vllm-omni's
W/16 x H/16. Through the planner, the model card, the engine's timings and the decode cache's size."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time

import pytest

from ar_service import events
from ar_service.engine import AREngine
from ar_service.planning import RequestPlanner
from ar_service.prompt import Grid, GridRule, grid_for_size
from protos.knobs import FAMILIES
from protos.status import RequestRejected
from servicekit.checkpoint import SERVING_FILE, open_checkpoint
from tests.ar_service.test_ar_batching import FakeRenderer

# A square of any size, and sizes of other aspect ratios: (width, height) -> the grid (w, h) and the tokens decoded.
RELEASED = [
    ((512, 512), (32, 32)),
    ((1024, 1024), (32, 32)),
    ((2048, 2048), (32, 32)),
    ((1536, 1024), (39, 26)),  # 3:2 -> 39x26 (exactly 3:2, 1,014 visual tokens)
    ((1024, 1536), (26, 39)),
    ((1024, 512), (45, 23)),   # 2:1 -> sqrt(2048) = 45.25, sqrt(512) = 22.6
    ((768, 1024), (28, 37)),   # 3:4 -> sqrt(768) = 27.7, sqrt(1365.3) = 36.95
]


def checkpoint_with(tiny_root, tmp_path, settings: dict):
    """A copy of the tiny AR checkpoint whose ardit_serving.json holds only ``settings`` (and an empty default negative
    prompt: the released one is longer than some tests' prompt limit)."""
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_root, root)
    (root / SERVING_FILE).write_text(json.dumps({"default_negative_prompt": "", **settings}))
    return open_checkpoint(root)


def planner(tiny_ar, checkpoint, **kw) -> RequestPlanner:
    return RequestPlanner(tiny_ar, checkpoint, FAMILIES[checkpoint.family], lambda decoding: True, **kw)


def header(tiny_ar, plan) -> str:
    """The image header at the end of the prompt the AR continues from."""
    text = tiny_ar.tokenizer.decode(plan.prompt_ids)
    return text[text.rindex("<|image start|>"):]


def test_token_budget_grid_keeps_the_aspect_ratio_and_about_the_budget():
    rule = GridRule()
    assert (rule.rule, rule.tokens) == ("token_budget", 1024)
    for (width, height), (w, h) in RELEASED:
        assert rule.grid(width, height) == Grid(w, h), (width, height)
    for side in range(16, 4097, 16):  # every square is the released 32x32, whatever its size
        assert rule.grid(side, side) == Grid(32, 32)
    for width in range(16, 2049, 48):
        for height in range(16, 2049, 80):
            grid = rule.grid(width, height)
            # each side is the nearest whole number to its exact value (computed here in floating point)
            assert abs(grid.width - math.sqrt(1024 * width / height)) <= 0.5 or grid.width == 1
            assert abs(grid.height - math.sqrt(1024 * height / width)) <= 0.5 or grid.height == 1
            if max(width, height) <= 2 * min(width, height):  # up to 2:1 the budget holds within 4 %
                assert abs(grid.width * grid.height - 1024) <= 41, (width, height, grid)
    assert GridRule(tokens=256).grid(1024, 1024) == Grid(16, 16)  # the Dev release's 16x16
    assert GridRule(tokens=1).grid(16, 4096) == Grid(1, 16)  # never below one token a side


def test_pixels_per_token_rule_is_vllm_omnis_grid():
    rule = GridRule("pixels_per_token", pixels_per_token=16)
    assert rule.grid(1024, 1024) == grid_for_size(1024, 1024, 16) == Grid(64, 64)
    assert rule.grid(512, 256) == Grid(32, 16)
    assert (rule.pixel_multiple, GridRule().pixel_multiple) == (16, 1)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        rule.grid(520, 512)
    with pytest.raises(ValueError, match="grid rule must be one of token_budget, pixels_per_token; got 'square'"):
        GridRule("square")


@pytest.mark.parametrize(("size", "grid"), RELEASED)
def test_a_checkpoint_without_grid_settings_plans_the_released_grid(tiny_ar, tiny_root, tmp_path, size, grid):
    checkpoint = checkpoint_with(tiny_root, tmp_path, {})
    assert (checkpoint.serving.grid_rule, checkpoint.serving.grid_tokens) == ("token_budget", 1024)
    plan = planner(tiny_ar, checkpoint).plan(prompt="a red fox in the snow", width=size[0], height=size[1])
    w, h = grid
    assert plan.grid == Grid(w, h)
    assert header(tiny_ar, plan) == f"<|image start|>{w}*{h}<|image token|>"
    assert plan.grid.decode_tokens == h * (w + 1) + 1  # the grid contract: rows of w tokens and an EOL, a look-ahead
    assert plan.image_positions == h * (w + 1)  # every row becomes the DiT's image condition (all_generated)
    assert (plan.width, plan.height) == size


def test_the_size_multiple_under_the_token_budget_is_the_dits_alone(tiny_ar, tiny_root, tmp_path):
    # pixels_per_token 32 is set but not the rule: sizes need only be multiples of the DiT's 16
    budget = planner(tiny_ar, checkpoint_with(tiny_root, tmp_path / "a", {"pixels_per_token": 32}))
    assert budget.size_multiple == 16 and budget.model_card()["size_multiple"] == 16
    assert budget.plan(prompt="a fox", width=528, height=528).grid == Grid(32, 32)
    per_pixel = planner(tiny_ar, checkpoint_with(
        tiny_root, tmp_path / "b", {"grid_rule": "pixels_per_token", "pixels_per_token": 32}))
    assert per_pixel.size_multiple == 32
    with pytest.raises(RequestRejected, match="multiples of 32") as refused:
        per_pixel.plan(prompt="a fox", width=528, height=528)
    assert refused.value.param == "size"


def test_an_explicit_pixels_per_token_rule_overrides_the_default(tiny_ar, tiny_root, tmp_path):
    checkpoint = checkpoint_with(tiny_root, tmp_path, {"grid_rule": "pixels_per_token"})
    plans = planner(tiny_ar, checkpoint)
    big = plans.plan(prompt="a red fox", width=768, height=768)  # 1024x1024's 64x64 is past the tiny's positions
    assert big.grid == Grid(48, 48) and header(tiny_ar, big) == "<|image start|>48*48<|image token|>"
    assert big.grid.decode_tokens == 48 * 49 + 1
    assert plans.plan(prompt="a red fox", width=512, height=256).grid == Grid(32, 16)
    assert plans.model_card()["grid"] == {"rule": "pixels_per_token", "pixels_per_token": 16}


def test_the_model_card_states_the_grid_rule(tiny_ar, tiny_root, tmp_path):
    released = planner(tiny_ar, checkpoint_with(tiny_root, tmp_path / "a", {}))
    assert released.model_card()["grid"] == {"rule": "token_budget", "tokens": 1024}
    smaller = planner(tiny_ar, checkpoint_with(tiny_root, tmp_path / "b", {"grid_tokens": 256}))
    assert smaller.model_card()["grid"] == {"rule": "token_budget", "tokens": 256}
    assert smaller.plan(prompt="a fox", width=1024, height=1024).grid == Grid(16, 16)


def test_max_positions_follows_the_grid_rule(tiny_ar, tiny_root, tmp_path):
    """The decode cache holds the longest accepted request: under the token budget the most tokens any accepted
    aspect ratio decodes (a tall thin size, 16x1328: a 4x292 grid), far fewer than 16 pixels a token's 128x128."""
    budget = planner(tiny_ar, checkpoint_with(tiny_root, tmp_path / "a", {}), max_prompt_tokens=16)
    per_pixel = planner(tiny_ar, checkpoint_with(tiny_root, tmp_path / "b", {"grid_rule": "pixels_per_token"}),
                        max_prompt_tokens=16)
    prompt = "x" * 16
    assert len(tiny_ar.tokenizer(prompt, add_special_tokens=False)["input_ids"]) == 16  # the longest prompt accepted
    thin = [(16, side) for side in range(16, 2049, 16)] + [(side, 16) for side in range(16, 2049, 16)]
    longest = max((budget.plan(prompt=prompt, width=w, height=h) for w, h in thin),
                  key=lambda plan: len(plan.prompt_ids) + plan.grid.decode_tokens)
    assert longest.grid == Grid(4, 292) and (longest.width, longest.height) == (16, 1328)
    # every accepted size's grid fits, by the rule itself: no other size decodes more
    assert max(GridRule().grid(w, h).decode_tokens for w in range(16, 2049, 16) for h in range(16, 2049, 16)) == 1461
    needed = len(longest.prompt_ids) + longest.grid.decode_tokens
    assert needed < budget.max_positions() <= needed + 4  # one scratch position, the widest header's digits
    # 16 pixels a token: 2048x2048 is a 128x128 grid (16,513 tokens), past the tiny model's 4,096 positions
    assert per_pixel.max_positions() == tiny_ar.config.max_position_embeddings + 1
    # within a pixel budget (ar_service's max_pixels) the tallest grid of it decodes the most: one EOL a row
    capped = planner(tiny_ar, checkpoint_with(tiny_root, tmp_path / "c", {"grid_rule": "pixels_per_token",
                                                                          "max_side": 1024}),
                     max_prompt_tokens=16, max_pixels=512 * 512)
    tall = capped.plan(prompt=prompt, width=256, height=1024)
    others = [capped.plan(prompt=prompt, width=w, height=h) for w, h in ((512, 512), (1024, 256), (240, 1024))]
    assert tall.grid == Grid(16, 64) and all(tall.grid.decode_tokens > plan.grid.decode_tokens for plan in others)
    needed = len(tall.prompt_ids) + tall.grid.decode_tokens
    assert needed < capped.max_positions() <= needed + 4


def _timings(engine: AREngine, **request) -> dict:
    job = engine.submit(engine.plan(prompt="a red fox in the snow", seed=5, **request))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        event = job.events.get(timeout=deadline - time.monotonic())
        if isinstance(event, events.JobFailed):
            raise AssertionError(event.error)
        if isinstance(event, events.JobDone):
            return event.timings
    raise AssertionError("the job did not finish")


def test_the_answers_timings_state_the_grid_once_per_request(tiny_ar, tiny_root, tmp_path):
    """Two images of 4x2 tokens: the tokens add up over the images, the grid is stated as it is."""
    engine = AREngine(tiny_ar, open_checkpoint(tiny_root), FAMILIES["mammothmoda2"], FakeRenderer())
    try:
        timings = _timings(engine, width=64, height=32, n=2)
    finally:
        engine.close()
    assert (timings["ar_grid_width"], timings["ar_grid_height"]) == (4, 2)
    assert timings["ar_tokens"] == 2 * (2 * 5 + 1)


def test_the_engine_decodes_the_released_grid_in_a_cache_sized_by_the_rule(tiny_ar, tiny_root, tmp_path):
    checkpoint = checkpoint_with(tiny_root, tmp_path, {"max_side": 512})
    engine = AREngine(tiny_ar, checkpoint, FAMILIES["mammothmoda2"], FakeRenderer(), fast_decode=True, max_batch_size=1,
                      max_prompt_tokens=32)
    try:
        assert engine.decoder.static.max_positions == engine.planner.max_positions()
        timings = _timings(engine, width=128, height=64, knobs={"ar_cfg_scale": 1.0})
    finally:
        engine.close()
    assert (timings["ar_grid_width"], timings["ar_grid_height"]) == (45, 23)
    assert timings["ar_tokens"] == 23 * 46 + 1


def test_the_grid_rule_stays_torch_free():
    """The gateway side may plan grids without torch: ar_service.prompt imports none."""
    code = "import sys, ar_service.prompt; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
