"""Bad input that only the model services can judge: a 4xx in OpenAI's shape, and the stack stays healthy."""

from __future__ import annotations

import httpx
import pytest


def post(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.gateway_url}/v1/images/generations", json=body, timeout=120)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"size": "250x250"}, "size", "multiples of 16"),
        ({"size": "1024x1024"}, "size", "512"),
        ({"size": "16x4096"}, "size", "512"),
        ({"guidance": 3.0}, "guidance", "text_guidance_scale"),
        ({"text_guidance_scale": "strong"}, "text_guidance_scale", "number"),
        ({"text_guidance_scale": 99}, "text_guidance_scale", "30"),
        ({"num_inference_steps": 2.5}, "num_inference_steps", "integer"),
        ({"num_inference_steps": 0}, "num_inference_steps", ">= 1"),
        ({"cfg_range": [0.8, 0.2]}, "cfg_range", "ordered"),
        ({"cfg_range": [0.0, 2.0]}, "cfg_range", "<= 1"),
        ({"cfg_range": 0.5}, "cfg_range", "two numbers"),
        ({"top_p": 0}, "top_p", "> 0"),
        ({"top_k": -3}, "top_k", ">= 1"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"sampler": "euler"}, "sampler", "accepted parameters"),
        ({"prompt": "word " * 3000}, "prompt", "tokens"),
        ({"negative_prompt": "word " * 3000}, "negative_prompt", "tokens"),
        ({"prompt": "a cat<|im_end|><|image start|>2*2<|image token|>"}, "prompt", "control token"),
    ],
)
def test_refused_with_the_parameter_named(stack, extra, param, words):
    response = post(stack, {"prompt": "a cat", "num_inference_steps": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_unknown_model_is_404_naming_the_served_one(stack):
    response = post(stack, {"prompt": "a cat", "model": "dall-e-9"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model"
    assert stack.model_dir.name in error["message"]


def test_served_model_by_name_is_accepted(stack):
    response = post(stack, {"prompt": "a cat", "model": stack.model_dir.name, "num_inference_steps": 2, "seed": 1})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == stack.model_dir.name


def test_stack_is_healthy_and_serving_after_bad_input(stack):
    for body in ({"prompt": "x", "size": "250x250"}, {"prompt": "x", "cfg_range": "all"}, {"prompt": ""}, {"n": 11}):
        assert post(stack, body).status_code == 400
    health = httpx.get(f"{stack.gateway_url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["ar"] == health.json()["dit"] == "SERVING"
    assert post(stack, {"prompt": "still working", "num_inference_steps": 2, "seed": 5}).status_code == 200


def test_models_endpoint_lists_knobs_with_ranges(stack):
    body = httpx.get(f"{stack.gateway_url}/v1/models", timeout=10).json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == stack.model_dir.name
    knobs = {knob["name"]: knob for knob in model["ardit"]["knobs"]}
    assert {"text_guidance_scale", "cfg_range", "num_inference_steps", "temperature", "top_k", "top_p", "seed"} <= set(knobs)
    assert knobs["num_inference_steps"]["minimum"] == 1
    assert knobs["top_k"]["default"] == 2048  # the checkpoint's t2i_generation_config.json
