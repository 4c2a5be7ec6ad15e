"""The images answer's body with the pictures spliced in: the bytes JSONResponse would send, and valid JSON in every
case a picture's text is not plain base64."""

from __future__ import annotations

import json
import os

import pytest
from fastapi.responses import JSONResponse

from gateway import json_body, streaming, translate
from gateway.protocol import ImageGenerationRequest
from protos import ar_pb2, common_pb2
from protos.values import to_value


def answer(pictures: list[bytes]) -> dict:
    """A real answer as the generations route builds it: two pictures, knobs, timings, the ignored fields."""
    request = ImageGenerationRequest.model_validate({"prompt": "un chat bleu", "n": len(pictures), "seed": 7,
                                                     "style": "vivid", "text_guidance_scale": 4.5})
    images = [common_pb2.GeneratedImage(index=i, seed=7 + i, format=common_pb2.OUTPUT_FORMAT_PNG, data=data,
                                        width=512, height=256) for i, data in enumerate(pictures)]
    completed = ar_pb2.GenerateImageResponse(
        request_id="img-abc", model="tiny", seed=7, width=512, height=256,
        timings=common_pb2.StageTimings(ar_decode_ms=20.125, denoise_ms=30.25, total_ms=60.0, ar_tokens=529),
        knobs={"text_guidance_scale": to_value(4.5), "cfg_range": to_value([0.0, 1.0])},
    )
    return translate.to_openai(request, images, completed, gateway_ms=0.5)


def test_the_answer_is_byte_for_byte_what_jsonresponse_renders():
    content = answer([os.urandom(300_000), b"\x89PNG tiny"])
    content["note"] = "déjà vu ✓ \"quoted\" \\ \n"  # non-ASCII and escapes outside the pictures
    body = json_body.PicturesJSONResponse(content).body
    assert body == JSONResponse(content).body
    assert json.loads(body) == content


@pytest.mark.parametrize("picture", ['a"b', "back\\slash", "naïve", None, 12, ["x"], {"nested": "b64"}])
def test_a_picture_field_that_is_not_plain_base64_is_rendered_the_ordinary_way(picture):
    content = {"data": [{"b64_json": picture, "seed": 1}], "created": 1}
    body = json_body.dumps(content)
    assert body == JSONResponse(content).body
    assert json.loads(body) == content


def test_what_json_refuses_is_refused():
    with pytest.raises(ValueError):
        json_body.dumps({"timings": {"total_ms": float("nan")}})
    with pytest.raises(TypeError):
        json_body.dumps({"timings": {1: 2.0}})
    with pytest.raises(TypeError):
        json_body.dumps({"data": object()})


def test_stream_events_carry_the_same_json():
    payload = {"type": "image_generation.completed", "b64_json": "QUJD", "size": "512x256", "note": "ü"}
    event = streaming.sse_event("image_generation.completed", payload)
    head, data, end = event.split(b"\n", 2)
    assert head == b"event: image_generation.completed" and end == b"\n"
    assert data.startswith(b"data: ") and json.loads(data.removeprefix(b"data: ")) == payload
    comment = streaming.sse_comment("ardit.completed", {"seeds": [1, 2]})
    assert comment == b': ardit.completed {"seeds":[1,2]}\n\n'
