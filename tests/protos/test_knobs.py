"""Knob validation: unknown, mistyped and out-of-range knobs are refused with the knob named."""

import pytest

from protos.knobs import MAMMOTHMODA2_KNOBS as KNOBS
from protos.status import RequestRejected


def rejected(knobs, stages=None):
    with pytest.raises(RequestRejected) as info:
        KNOBS.validate(knobs, stages)
    return info.value


def test_valid_knobs_come_back_canonical():
    checked = KNOBS.validate({"text_guidance_scale": 4, "num_inference_steps": 8.0, "cfg_range": [0, 0.5], "top_k": 16})
    assert checked == {"text_guidance_scale": 4.0, "num_inference_steps": 8, "cfg_range": [0.0, 0.5], "top_k": 16}
    assert isinstance(checked["num_inference_steps"], int)


def test_unknown_knob_names_every_accepted_one():
    error = rejected({"guidance": 3})
    assert error.param == "guidance"
    for name in ("text_guidance_scale", "cfg_range", "num_inference_steps", "temperature", "top_k", "top_p", "seed"):
        assert name in error.message


@pytest.mark.parametrize(
    "knobs, param",
    [
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 201}, "num_inference_steps"),
        ({"num_inference_steps": 4.5}, "num_inference_steps"),
        ({"num_inference_steps": "4"}, "num_inference_steps"),
        ({"num_inference_steps": True}, "num_inference_steps"),
        ({"text_guidance_scale": -1}, "text_guidance_scale"),
        ({"text_guidance_scale": "high"}, "text_guidance_scale"),
        ({"text_guidance_scale": float("nan")}, "text_guidance_scale"),
        ({"cfg_range": [0.5, 0.25]}, "cfg_range"),
        ({"cfg_range": [0.0, 1.5]}, "cfg_range"),
        ({"cfg_range": [0.5]}, "cfg_range"),
        ({"cfg_range": 0.5}, "cfg_range"),
        ({"cfg_range": ["a", "b"]}, "cfg_range"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"temperature": -0.1}, "temperature"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_values_are_refused_naming_the_knob(knobs, param):
    error = rejected(knobs)
    assert error.param == param
    assert param in error.message


def test_stage_filter_refuses_knobs_of_other_stages():
    error = rejected({"top_k": 5}, stages=("dit",))
    assert error.param == "top_k"


def test_resolve_fills_defaults_and_prefers_given_ones():
    resolved = KNOBS.resolve({"num_inference_steps": 4}, {}, stages=("dit",))
    assert resolved == {"num_inference_steps": 4, "text_guidance_scale": 9.0, "image_guidance_scale": 2.0,
                        "cfg_range": [0.0, 1.0], "cfg_execution_mode": "sequential", "dit_cache_threshold": 0.0}
    ar = KNOBS.resolve({}, {"temperature": 1.0, "top_k": 2048, "top_p": 1.0}, stages=("ar",))
    assert ar == {"temperature": 1.0, "top_k": 2048, "top_p": 1.0, "ar_decoding": "sequential", "ar_decoding_window": 0}


def test_quality_presets():
    assert KNOBS.steps_for_quality("auto") is None
    assert KNOBS.steps_for_quality("") is None
    assert KNOBS.steps_for_quality("low") < KNOBS.steps_for_quality("medium") <= KNOBS.steps_for_quality("high")
    with pytest.raises(RequestRejected) as info:
        KNOBS.steps_for_quality("ultra")
    assert info.value.param == "quality"


def test_cfg_execution_mode_choices():
    assert KNOBS.validate({"cfg_execution_mode": "packed"}) == {"cfg_execution_mode": "packed"}
    with pytest.raises(RequestRejected, match="cfg_execution_mode"):
        KNOBS.validate({"cfg_execution_mode": "parallel"})
