"""A checkpoint's own knob defaults (ardit_serving.json ``knob_defaults``): what a request that leaves a knob out
gets in ar_service's plan and model card; a wrong one stops the start. dit_service's side:
tests/dit_service/test_checkpoint_knob_defaults.py."""

from __future__ import annotations

import dataclasses

import pytest

from ar_service.engine import AREngine
from ar_service.render_client import GrpcRenderer
from protos.knobs import FAMILIES
from servicekit.checkpoint import open_checkpoint

# Planning never opens a render: a renderer address nothing listens on will do.
NOWHERE = "127.0.0.1:9"
DEFAULTS = {"num_inference_steps": 12, "text_guidance_scale": 2.5, "temperature": 0.5}


@pytest.fixture(scope="module")
def checkpoint(tiny_root):
    plain = open_checkpoint(tiny_root)
    return dataclasses.replace(plain, serving=dataclasses.replace(plain.serving, knob_defaults=DEFAULTS))


def test_ar_service_plans_and_publishes_the_checkpoints_defaults(tiny_ar, checkpoint):
    engine = AREngine(tiny_ar, checkpoint, FAMILIES[checkpoint.family], GrpcRenderer(NOWHERE))
    try:
        plan = engine.plan(prompt="a harbour", width=64, height=64)
        assert (plan.dit_knobs["num_inference_steps"], plan.dit_knobs["text_guidance_scale"]) == (12, 2.5)
        assert plan.sampling.temperature == 0.5
        asked = engine.plan(prompt="a harbour", width=64, height=64, knobs={"text_guidance_scale": 7.0})
        assert asked.dit_knobs["text_guidance_scale"] == 7.0 and asked.dit_knobs["num_inference_steps"] == 12
        card = {entry["knob"].name: entry["default"] for entry in engine.model_card()["knobs"]}
        assert {name: card[name] for name in DEFAULTS} == DEFAULTS
    finally:
        engine.close()


@pytest.mark.parametrize(("defaults", "message"), [
    ({"guidance": 3}, "unknown parameter 'guidance'; accepted parameters: .*text_guidance_scale"),
    ({"num_inference_steps": 0}, "'num_inference_steps' must be"),
    ({"seed": 3}, "unknown parameter 'seed'"),
])
def test_a_wrong_default_stops_the_start_naming_it(tiny_ar, checkpoint, defaults, message):
    wrong = dataclasses.replace(checkpoint, serving=dataclasses.replace(checkpoint.serving, knob_defaults=defaults))
    with pytest.raises(ValueError, match=f"ardit_serving.json knob_defaults: {message}"):
        AREngine(tiny_ar, wrong, FAMILIES[wrong.family], GrpcRenderer(NOWHERE))
