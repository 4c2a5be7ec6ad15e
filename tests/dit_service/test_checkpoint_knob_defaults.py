"""A checkpoint's own knob defaults (ardit_serving.json ``knob_defaults``) fill the DiT knobs that a Render header
leaves out (callers that reach Render directly); a wrong one stops the start."""

from __future__ import annotations

import pytest

from dit_service.engine import DiTEngine
from protos.knobs import FAMILIES

HIDDEN = 64


def plan(engine: DiTEngine, knobs: dict):
    return engine.plan(request_id="r", width=64, height=64, n=1, seed=1, output_format="png", output_compression=None,
                       knobs=knobs, hidden_size=HIDDEN, dtype="float32", text_positions=4, image_positions=6,
                       negative_positions=0)


def test_a_render_header_without_knobs_gets_the_checkpoints_defaults(pipeline):
    engine = DiTEngine(pipeline, FAMILIES["mammothmoda2"], 4096,
                       knob_defaults={"num_inference_steps": 12, "text_guidance_scale": 2.5, "temperature": 0.5})
    try:
        knobs = plan(engine, {}).knobs
        assert (knobs["num_inference_steps"], knobs["text_guidance_scale"]) == (12, 2.5)
        assert "temperature" not in knobs  # an AR knob: ar_service's business
        assert plan(engine, {"text_guidance_scale": 7.0}).knobs["text_guidance_scale"] == 7.0
    finally:
        engine.close()
    plain = DiTEngine(pipeline, FAMILIES["mammothmoda2"], 4096)
    try:
        assert plan(plain, {}).knobs["text_guidance_scale"] == FAMILIES["mammothmoda2"]["text_guidance_scale"].default
    finally:
        plain.close()


def test_a_wrong_default_stops_the_start_naming_it(pipeline):
    with pytest.raises(ValueError, match="knob_defaults: 'text_guidance_scale' must be"):
        DiTEngine(pipeline, FAMILIES["mammothmoda2"], 4096, knob_defaults={"text_guidance_scale": "strong"})
