"""OpenAI's request fields are not knobs: each is taken with the values OpenAI documents for it, and one that changes
nothing for the served model is named in the answer instead of refused.

The field list and value sets are OpenAI's API reference, "Create image" (developers.openai.com/api/reference/resources/
images/methods/generate) and openai-python 3.63's ``openai/types/image_generate_params.py`` (generated from the same
OpenAPI spec)."""

from __future__ import annotations

import pytest

from gateway import translate
from gateway.app import create_app, inline_refs
from gateway.errors import APIError
from gateway.protocol import ImageGenerationRequest
from gateway.settings import GatewaySettings
from protos.values import knobs_from_proto

#: Every body field of POST /v1/images/generations in OpenAI's reference, with its documented values.
OPENAI_FIELDS = {
    "prompt": ["a cat"],
    "model": ["gpt-image-1", "dall-e-3"],
    "n": [1, 10],
    "size": ["auto", "1024x1024", "1536x1024", "1024x1536", "256x256", "512x512", "1792x1024", "1024x1792"],
    "quality": ["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"],
    "response_format": ["url", "b64_json"],
    "output_format": ["png", "jpeg", "webp", "gif", "svg"],
    "output_compression": [0, 100],
    "background": ["transparent", "opaque", "auto"],
    "moderation": ["low", "auto"],
    "style": ["vivid", "natural"],
    "complexity": ["low", "medium", "high"],
    "frame_count": [2, 16],
    "frame_duration_ms": [0, 200, 655350],
    "svg": [{"model": "any"}, {"model": "any", "reasoning": {"effort": "max"}}, {"model": "any", "reasoning": None}],
    "partial_images": [0, 3],
    "stream": [False, True],
    "user": ["user-1234"],
    "safety_identifier": ["hash-of-user"],
}
#: OpenAI's values ardit cannot honour and a client would misread if they were dropped: a 400 that says so.
REFUSED = {("background", "transparent"), ("output_format", "gif"), ("output_format", "svg")}
#: Nullable in OpenAI's reference: null means the default.
NULLABLE = set(OPENAI_FIELDS) - {"prompt", "user"}


def request(**fields) -> ImageGenerationRequest:
    return ImageGenerationRequest.model_validate({"prompt": "a cat", **fields})


@pytest.mark.parametrize("field", sorted(OPENAI_FIELDS))
def test_every_openai_field_is_declared_not_a_knob(field):
    assert field in ImageGenerationRequest.model_fields
    for value in OPENAI_FIELDS[field]:
        parsed = request(**{field: value})
        assert field not in parsed.knobs
        if isinstance(value, str) and (field, value) in REFUSED:
            with pytest.raises(APIError) as refused:
                parsed.check_supported()
            assert (refused.value.status, refused.value.param, refused.value.code) == (400, field, "unsupported_value")
        else:
            parsed.check_supported()
            assert field not in knobs_from_proto(translate.to_proto(parsed).knobs)


@pytest.mark.parametrize("field", sorted(NULLABLE))
def test_null_is_the_default(field):
    assert request(**{field: None}) == request()


def test_the_documented_schema_admits_null_where_openai_does():
    body = inline_refs(ImageGenerationRequest.model_json_schema())
    for field in NULLABLE:
        kinds = [option.get("type") for option in body["properties"][field].get("anyOf", [])]
        assert "null" in kinds, (field, body["properties"][field])
    assert "$ref" not in str(body) and "$defs" not in body
    document = create_app(GatewaySettings()).openapi()
    headers = document["paths"]["/v1/images/generations"]["post"]["responses"]["200"]["headers"]
    assert "X-Ardit-Ignored-Fields" in headers


@pytest.mark.parametrize(
    ("fields", "ignored"),
    [
        ({}, []),
        ({"style": "vivid"}, ["style"]),
        ({"style": "natural", "moderation": "auto", "complexity": "low"}, ["complexity", "moderation", "style"]),
        ({"moderation": "low"}, ["moderation"]),
        ({"frame_count": 4, "frame_duration_ms": 100}, ["frame_count", "frame_duration_ms"]),
        ({"svg": {"model": "any"}}, ["svg"]),
        ({"output_compression": 100}, ["output_compression"]),  # png: lossless
        ({"output_format": "png", "output_compression": 50}, ["output_compression"]),
        ({"output_format": "jpeg", "output_compression": 50}, []),
        ({"output_format": "webp", "output_compression": 0}, []),
        ({"partial_images": 2}, ["partial_images"]),
        ({"partial_images": 0, "stream": False}, ["partial_images"]),
        ({"partial_images": 2, "stream": True}, []),
        ({"response_format": "url", "stream": True}, ["response_format"]),  # events carry b64_json
        ({"response_format": "b64_json", "stream": True}, []),
        ({"response_format": "url"}, []),
        ({"quality": "hd"}, []),
        ({"quality": "hd", "num_inference_steps": 8}, ["quality"]),  # the steps asked for win
        ({"quality": "auto", "num_inference_steps": 8}, []),
        ({"background": "opaque", "user": "u", "safety_identifier": "s", "n": 2, "size": "auto"}, []),
        ({"style": None, "moderation": None, "partial_images": None, "svg": None}, []),
    ],
)
def test_fields_without_effect_are_named(fields, ignored):
    parsed = request(**fields)
    assert parsed.ignored_fields() == ignored
    assert translate.ignored_fields_headers(parsed) == ({"X-Ardit-Ignored-Fields": ", ".join(ignored)} if ignored else {})


def test_what_goes_to_ar_service():
    assert translate.to_proto(request(quality="xhigh")).quality == "high"  # the highest preset the model has
    assert translate.to_proto(request(quality="max")).quality == "high"
    assert translate.to_proto(request(quality="hd")).quality == "hd"
    assert not translate.to_proto(request(output_compression=80)).HasField("output_compression")  # png
    assert translate.to_proto(request(output_format="webp", output_compression=80)).output_compression == 80
    assert translate.to_proto(request(partial_images=3)).partial_images == 0  # without stream
    assert translate.to_proto(request(partial_images=3, stream=True)).partial_images == 3
    message = translate.to_proto(request(style="vivid", moderation="low", complexity="high", svg={"model": "m"},
                                         frame_count=3, safety_identifier="s", num_inference_steps=4))
    assert knobs_from_proto(message.knobs) == {"num_inference_steps": 4}


def test_the_end_user_is_safety_identifier_before_user():
    assert request(user="u", safety_identifier="s").end_user == "s"
    assert request(user="u", safety_identifier="").end_user == "u"
    assert request(user="u").end_user == "u"
    assert request().end_user is None
