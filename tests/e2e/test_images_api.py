"""The whole pipeline over the wire: gateway -> ar_service -> dit_service and back."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from openai import OpenAI
from PIL import Image

FAST = {"num_inference_steps": 4}


def generate(stack, **body) -> httpx.Response:
    payload = {"prompt": "a red fox in the snow", **FAST, **body}
    return httpx.post(f"{stack.gateway_url}/v1/images/generations", json=payload, timeout=120)


def image_bytes(item: dict) -> bytes:
    return base64.b64decode(item["b64_json"])


def test_openai_client_gets_an_image_of_the_requested_size(stack):
    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="not-checked", max_retries=0)
    result = client.images.generate(
        prompt="a lighthouse at dusk",
        size="256x256",
        response_format="b64_json",
        extra_body={"text_guidance_scale": 3.0, "num_inference_steps": 4, "seed": 11},
    )
    assert len(result.data) == 1
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.format == "PNG" and image.size == (256, 256)
    extras = result.model_extra
    assert extras["seed"] == 11 and extras["seeds"] == [11]


def test_non_square_size_is_width_by_height(stack):
    response = generate(stack, size="512x256", seed=1)
    assert response.status_code == 200, response.text
    image = Image.open(io.BytesIO(image_bytes(response.json()["data"][0])))
    assert image.size == (512, 256)
    assert response.json()["size"] == "512x256"
    # the tiny model's grid rule (its ardit_serving.json): one token per 16x16 pixels, so 32x16 tokens
    timings = response.json()["timings"]
    assert (timings["ar_grid_width"], timings["ar_grid_height"]) == (32, 16)
    assert timings["ar_tokens"] == 16 * 33 + 1


def test_the_model_card_states_the_grid_rule(stack):
    (model,) = httpx.get(f"{stack.gateway_url}/v1/models", timeout=30).json()["data"]
    assert model["ardit"]["grid"] == {"rule": "pixels_per_token", "pixels_per_token": 16}


def test_same_seed_same_bytes_and_different_seed_different_image(stack):
    first = generate(stack, seed=1234)
    second = generate(stack, seed=1234)
    other = generate(stack, seed=1235)
    assert first.status_code == second.status_code == other.status_code == 200
    a, b, c = (image_bytes(r.json()["data"][0]) for r in (first, second, other))
    assert a == b
    assert a != c


def test_n_images_use_consecutive_seeds(stack):
    pair = generate(stack, seed=500, n=2)
    assert pair.status_code == 200, pair.text
    body = pair.json()
    assert body["seeds"] == [500, 501]
    # the tokens add up over the images; the grid is the one both had
    assert body["timings"]["ar_tokens"] == 2 * (16 * 17 + 1)
    assert (body["timings"]["ar_grid_width"], body["timings"]["ar_grid_height"]) == (16, 16)
    images = [image_bytes(item) for item in body["data"]]
    assert images[0] != images[1]
    alone = generate(stack, seed=501)
    assert image_bytes(alone.json()["data"][0]) == images[1]
    first_alone = generate(stack, seed=500)
    assert image_bytes(first_alone.json()["data"][0]) == images[0]


def test_request_without_seed_is_told_its_seed(stack):
    response = generate(stack)
    body = response.json()
    assert isinstance(body["seed"], int)
    replay = generate(stack, seed=body["seed"])
    assert image_bytes(replay.json()["data"][0]) == image_bytes(body["data"][0])


def test_response_reports_stage_timings_and_guidance_calls(stack):
    body = generate(stack, seed=3, text_guidance_scale=4.0, cfg_range=[0.0, 1.0]).json()
    timings = body["timings"]
    for stage in ("ar_prefill_ms", "ar_decode_ms", "denoise_ms", "vae_decode_ms", "encode_ms", "total_ms"):
        assert timings[stage] > 0, stage
    assert timings["ar_tokens"] == 16 * 17 + 1  # 256x256 at 16 pixels per token
    assert (timings["ar_grid_width"], timings["ar_grid_height"]) == (16, 16)
    assert timings["transformer_calls"] == 8  # 4 steps, guidance everywhere
    narrow = generate(stack, seed=3, text_guidance_scale=4.0, cfg_range=[0.25, 0.5]).json()
    assert narrow["timings"]["transformer_calls"] == 6
    off = generate(stack, seed=3, text_guidance_scale=1.0).json()
    assert off["timings"]["transformer_calls"] == 4
    assert (off["timings"]["dit_steps_computed"], off["timings"]["dit_steps_skipped"]) == (4, 0)


def test_step_caching_counts_reach_the_client(stack):
    """The DiT's computed and skipped step counts travel back through the AR and the gateway."""
    body = generate(stack, seed=3, num_inference_steps=12, dit_cache_threshold=1.0).json()
    timings = body["timings"]
    assert timings["dit_steps_computed"] + timings["dit_steps_skipped"] == 12
    assert timings["dit_steps_skipped"] > 0


def test_speculative_decoding_gives_the_same_image_in_fewer_ar_forwards(stack):
    sequential = generate(stack, seed=8, size="128x128").json()
    fast = generate(stack, seed=8, size="128x128", ar_decoding="speculative").json()
    assert image_bytes(fast["data"][0]) == image_bytes(sequential["data"][0])
    assert fast["timings"]["ar_tokens"] == sequential["timings"]["ar_tokens"] == 8 * 9 + 1
    assert fast["timings"]["ar_forwards"] < sequential["timings"]["ar_forwards"] == 8 * 9
    lossy = generate(stack, seed=8, size="128x128", ar_decoding="row_parallel", ar_decoding_window=2).json()
    assert lossy["timings"]["ar_forwards"] < sequential["timings"]["ar_forwards"] / 2
    refused = generate(stack, seed=8, ar_decoding="jacobi")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "ar_decoding" and "row_parallel" in refused.json()["error"]["message"]


def test_guidance_and_steps_change_the_image(stack):
    base = image_bytes(generate(stack, seed=9, text_guidance_scale=4.0).json()["data"][0])
    assert image_bytes(generate(stack, seed=9, text_guidance_scale=2.0).json()["data"][0]) != base
    assert image_bytes(generate(stack, seed=9, text_guidance_scale=4.0, num_inference_steps=3).json()["data"][0]) != base


def test_negative_prompt_changes_the_image(stack):
    plain = generate(stack, seed=21, text_guidance_scale=4.0)
    negative = generate(stack, seed=21, text_guidance_scale=4.0, negative_prompt="blurry, dark")
    assert negative.status_code == 200, negative.text
    assert image_bytes(plain.json()["data"][0]) != image_bytes(negative.json()["data"][0])


@pytest.mark.parametrize("fmt, pil_name", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_formats(stack, fmt, pil_name):
    response = generate(stack, seed=2, output_format=fmt)
    assert response.status_code == 200, response.text
    assert response.json()["output_format"] == fmt
    image = Image.open(io.BytesIO(image_bytes(response.json()["data"][0])))
    assert image.format == pil_name and image.size == (256, 256)


def test_output_compression_shrinks_jpeg(stack):
    light = image_bytes(generate(stack, seed=2, output_format="jpeg", output_compression=5).json()["data"][0])
    heavy = image_bytes(generate(stack, seed=2, output_format="jpeg", output_compression=90).json()["data"][0])
    assert len(heavy) < len(light)


def test_quality_maps_to_a_step_preset_unless_steps_are_given(stack):
    payload = {"prompt": "a bowl of fruit", "seed": 4, "quality": "low"}
    low = httpx.post(f"{stack.gateway_url}/v1/images/generations", json=payload, timeout=120).json()
    assert low["knobs"]["num_inference_steps"] == 16
    explicit = httpx.post(
        f"{stack.gateway_url}/v1/images/generations", json={**payload, "num_inference_steps": 3}, timeout=120
    ).json()
    assert explicit["knobs"]["num_inference_steps"] == 3
