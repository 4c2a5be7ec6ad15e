"""Everything the gateway refuses by itself answers 4xx in OpenAI's error shape, naming the parameter."""

from __future__ import annotations

import pytest

URL = "/v1/images/generations"
OK = {"prompt": "a red fox in the snow"}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({}, "prompt", "prompt"),
        ({"n": 2}, "prompt", "required"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": "   \n\t"}, "prompt", "empty"),
        ({"prompt": 42}, "prompt", "string"),
        ({"prompt": ["a", "b"]}, "prompt", "string"),
        ({**OK, "n": 0}, "n", "1"),
        ({**OK, "n": 11}, "n", "10"),
        ({**OK, "n": "2"}, "n", "integer"),
        ({**OK, "n": 2.0}, "n", "integer"),
        ({**OK, "n": True}, "n", "integer"),
        ({**OK, "size": "big"}, "size", "WIDTHxHEIGHT"),
        ({**OK, "size": "512"}, "size", "WIDTHxHEIGHT"),
        ({**OK, "size": "0x512"}, "size", "positive"),
        ({**OK, "size": "512x0"}, "size", "positive"),
        ({**OK, "size": "-512x512"}, "size", "WIDTHxHEIGHT"),
        ({**OK, "size": 512}, "size", "string"),
        ({**OK, "quality": "ultra"}, "quality", "one of 'auto', 'low', 'medium', 'high', 'xhigh', 'max', 'standard', "
                                             "'hd'; got \"ultra\""),
        ({**OK, "response_format": "bmp"}, "response_format", "bmp"),
        ({**OK, "output_format": "bmp"}, "output_format", "one of 'png', 'jpeg', 'webp', 'gif', 'svg'; got \"bmp\""),
        ({**OK, "output_format": "gif"}, "output_format", "'png', 'jpeg', 'webp'"),  # OpenAI's, but not drawn here
        ({**OK, "output_format": "svg"}, "output_format", "'png', 'jpeg', 'webp'"),
        ({**OK, "output_format": "jpeg", "output_compression": -1}, "output_compression", "from 0 to 100; got -1"),
        ({**OK, "output_format": "jpeg", "output_compression": 101}, "output_compression", "from 0 to 100; got 101"),
        ({**OK, "output_format": "webp", "output_compression": "50"}, "output_compression", "integer"),
        ({**OK, "background": "transparent"}, "background", "opaque"),
        ({**OK, "background": "green"}, "background", "one of 'auto', 'opaque', 'transparent'; got \"green\""),
        ({**OK, "style": "loud"}, "style", "'style' must be one of 'vivid', 'natural'; got \"loud\""),
        ({**OK, "style": 1}, "style", "one of 'vivid', 'natural'"),
        ({**OK, "moderation": "high"}, "moderation", "one of 'low', 'auto'"),
        ({**OK, "complexity": "max"}, "complexity", "one of 'low', 'medium', 'high'"),
        ({**OK, "frame_count": 1}, "frame_count", "from 2 to 16"),
        ({**OK, "frame_count": 17}, "frame_count", "from 2 to 16"),
        ({**OK, "frame_duration_ms": -10}, "frame_duration_ms", ">= 0"),
        ({**OK, "svg": "yes"}, "svg", "object"),
        ({**OK, "svg": {}}, "svg", "svg.model"),
        ({**OK, "svg": {"model": "x", "colours": 3}}, "svg", "'svg.colours' is not a field of 'svg'"),
        ({**OK, "svg": {"model": "x", "reasoning": {"effort": "huge"}}}, "svg", "huge"),
        ({**OK, "safety_identifier": 7}, "safety_identifier", "string"),
        ({**OK, "stream": "yes"}, "stream", "true or false"),
        ({**OK, "stream": True, "partial_images": 4}, "partial_images", "from 0 to 3"),
        ({**OK, "stream": True, "partial_images": -1}, "partial_images", "from 0 to 3"),
        ({**OK, "stream": True, "partial_images": "2"}, "partial_images", "integer"),
        ({**OK, "partial_images": 9}, "partial_images", "from 0 to 3"),  # checked without stream too
        ({**OK, "seed": -1}, "seed", "0"),
        ({**OK, "seed": 2**63}, "seed", "9223372036854775807"),
        ({**OK, "seed": "7"}, "seed", "integer"),
        ({**OK, "negative_prompt": 3}, "negative_prompt", "string"),
        ({**OK, "user": 3}, "user", "string"),
        ({**OK, "model": 3}, "model", "string"),
    ],
)
def test_bad_field_is_400_naming_it(client, openai_error, body, param, words):
    error = openai_error(client.post(URL, json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert words in error["message"], error["message"]
    assert error["code"] in ("invalid_value", "invalid_type", "unsupported_value", "missing_required_parameter"), error


@pytest.mark.parametrize(
    "content",
    [b'{"prompt": "a cat",', b"not json", b'{"prompt": NaN}', b"\xff\xfe\x00", b""],
)
def test_malformed_json_is_400_invalid_json(client, openai_error, content):
    response = client.post(URL, content=content, headers={"content-type": "application/json"})
    error = openai_error(response, 400, None)
    assert error["code"] == "invalid_json"
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b"[1, 2]", b'"a cat"', b"null"])
def test_body_that_is_not_an_object_is_400(client, openai_error, content):
    error = openai_error(client.post(URL, content=content, headers={"content-type": "application/json"}), 400, None)
    assert "object" in error["message"]


def test_body_over_the_limit_is_413(client, openai_error, settings):
    body = {"prompt": "x" * (settings.max_body_bytes + 10)}
    error = openai_error(client.post(URL, json=body), 413, None)
    assert str(settings.max_body_bytes) in error["message"]
    assert error["code"] == "request_too_large"


def test_streamed_body_over_the_limit_is_413_without_content_length(client, openai_error, settings):
    def chunks():  # chunked transfer: no Content-Length, the bytes are counted as they arrive
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * (settings.max_body_bytes // 4)
        yield b'"}'

    response = client.post(URL, content=chunks(), headers={"content-type": "application/json"})
    openai_error(response, 413, None)


def test_unknown_route_is_404_in_openai_shape(client, openai_error):
    error = openai_error(client.get("/v1/nothing-here"), 404, None)
    assert error["type"] == "invalid_request_error"


def test_wrong_method_is_405_in_openai_shape(client, openai_error):
    response = client.get(URL)
    openai_error(response, 405, None)
    assert "POST" in response.headers.get("allow", "")


def test_valid_request_without_backend_is_503_not_500(client, openai_error, settings):
    body = {**OK, "size": "256x256", "n": 2, "seed": 5, "text_guidance_scale": 4.0, "user": "alice"}
    response = client.post(URL, json=body)
    error = openai_error(response, 503, None)
    assert error["type"] == "server_error"
    assert "ar_service" in error["message"] and settings.ar_address in error["message"]
    assert response.headers["x-request-id"].startswith("img-")


def test_models_without_backend_is_503(client, openai_error):
    openai_error(client.get("/v1/models"), 503, None)
    openai_error(client.get("/v1/models/tiny"), 503, None)


def test_health_is_503_naming_what_is_down(client):
    response = client.get("/health")
    assert response.status_code == 503, response.text
    assert response.json() == {"status": "unavailable", "ar": "UNREACHABLE", "dit": "UNREACHABLE"}


def test_accepted_openai_values_pass_validation(client):
    """Valid requests reach the (absent) backend: 503, never a 4xx from the gateway."""
    for extra in (
        {"size": "auto", "quality": "hd", "response_format": "b64_json", "background": "opaque"},
        {"output_format": "jpeg", "output_compression": 0, "background": "auto", "stream": False},
        {"output_format": "webp", "output_compression": 100, "response_format": None, "background": None},
        {"model": "tiny", "user": "u1", "negative_prompt": "blurry", "seed": 2**63 - 1, "n": 10},
        {"cfg_range": [0.0, 1.0], "num_inference_steps": 4},  # knobs: ar_service judges them
        {"style": "vivid", "moderation": "low", "complexity": "high", "quality": "max", "safety_identifier": "h1"},
        {"style": "natural", "moderation": "auto", "quality": "xhigh", "frame_count": 16, "frame_duration_ms": 0},
        {"svg": {"model": "any", "reasoning": {"effort": "none"}}, "output_compression": 50, "partial_images": 3},
        {"n": None, "size": None, "quality": None, "output_format": None, "stream": None, "style": None, "svg": None},
    ):
        assert client.post(URL, json={**OK, **extra}).status_code == 503, extra


def test_unexpected_error_is_a_generic_500_without_details(client, openai_error, monkeypatch):
    from gateway import translate

    def boom(*args, **kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(translate, "to_proto", boom)
    response = client.post(URL, json=OK)
    error = openai_error(response, 500, None)
    assert error["type"] == "server_error"
    assert "secret" not in response.text
