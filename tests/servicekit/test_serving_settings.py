"""ardit_serving.json: the checkpoint's serving settings, the released-behaviour switches among them."""

from __future__ import annotations

import json

import pytest

from servicekit.checkpoint import (
    RELEASED_NEGATIVE_PROMPT,
    SERVING_FILE,
    ServingDefaults,
    open_checkpoint,
    write_serving_defaults,
)


@pytest.fixture
def root(tmp_path):
    config = {"model_type": "mammothmoda2", "llm_config": {"model_type": "mammothmoda2_qwen2_5_vl"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_defaults_follow_ardit_and_the_released_negative_prompt(root):
    serving = open_checkpoint(root, require_weights=False).serving
    assert serving == ServingDefaults()
    assert (serving.condition_scope, serving.visual_token_scope, serving.cfg_range_policy) == (
        "all_generated", "exclusive_end", "per_step")
    assert serving.default_negative_prompt == RELEASED_NEGATIVE_PROMPT
    assert RELEASED_NEGATIVE_PROMPT.startswith("deformed, blurry") and RELEASED_NEGATIVE_PROMPT.endswith("instruction.")
    # the released grid: about 1,024 visual tokens (32x32 for a square), not vllm-omni's 16 pixels a token
    assert (serving.grid_rule, serving.grid_tokens) == ("token_budget", 1024)


def test_vllm_omnis_grid_is_one_setting_away(root):
    (root / SERVING_FILE).write_text(json.dumps({"grid_rule": "pixels_per_token"}))
    serving = open_checkpoint(root, require_weights=False).serving
    assert (serving.grid_rule, serving.pixels_per_token) == ("pixels_per_token", 16)


def test_the_released_behaviour_is_a_setting_away(root):
    released = ServingDefaults(default_negative_prompt="", condition_scope="answer_window",
                               visual_token_scope="start_plus_end", cfg_range_policy="off_after_first_exit")
    write_serving_defaults(root, released)
    assert open_checkpoint(root, require_weights=False).serving == released


@pytest.mark.parametrize(("data", "message"), [
    ({"condition_scope": "some"}, "condition_scope must be one of all_generated, answer_window, prompt_tail; got 'some'"),
    ({"cfg_range_policy": "latched"}, "cfg_range_policy must be one of per_step, off_after_first_exit"),
    ({"default_negative_prompt": None}, "default_negative_prompt must be a string"),
    ({"pixels_per_token": "16"}, "pixels_per_token must be an integer"),
    ({"pixels_per_token": 0}, "pixels_per_token must be at least 1; got 0"),
    ({"grid_rule": "square"}, "grid_rule must be one of token_budget, pixels_per_token; got 'square'"),
    ({"grid_rule": 16}, "grid_rule must be a string"),
    ({"grid_tokens": 0}, "grid_tokens must be at least 1; got 0"),
    ({"grid_tokens": 1024.0}, "grid_tokens must be an integer"),
    ({"negative": "x"}, "unknown keys"),
])
def test_a_bad_setting_is_refused_naming_it(root, data, message):
    (root / SERVING_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        open_checkpoint(root, require_weights=False)


def test_knob_defaults_round_trip_and_must_be_an_object(root):
    serving = ServingDefaults(knob_defaults={"num_inference_steps": 50, "text_guidance_scale": 3.0})
    write_serving_defaults(root, serving)
    assert open_checkpoint(root, require_weights=False).serving == serving
    (root / SERVING_FILE).write_text(json.dumps({"knob_defaults": [3]}))
    with pytest.raises(ValueError, match="knob_defaults must be an object"):
        open_checkpoint(root, require_weights=False)
