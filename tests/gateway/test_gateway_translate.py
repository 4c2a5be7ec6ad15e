"""OpenAI request -> GenerateImageRequest, and the gRPC answer -> OpenAI response."""

from __future__ import annotations

import base64

import grpc
import pytest

from gateway import errors, translate
from gateway.protocol import ImageGenerationRequest
from protos import ar_pb2, common_pb2
from protos.status import PARAM_METADATA_KEY
from protos.values import from_value, to_value


def request(**fields) -> ImageGenerationRequest:
    return ImageGenerationRequest.model_validate({"prompt": "a cat", **fields})


def test_defaults_translate_to_size_auto_and_png():
    message = translate.to_proto(request())
    assert message.request_id.startswith("img-") and len(message.request_id) == 4 + 32
    assert (message.width, message.height, message.n) == (0, 0, 1)
    assert message.prompt == "a cat" and message.negative_prompt == "" and message.model == ""
    assert not message.HasField("seed")
    assert not message.HasField("output_compression")
    assert message.output_format == common_pb2.OUTPUT_FORMAT_PNG
    assert message.quality == "auto"
    assert dict(message.knobs) == {}


def test_standard_fields_go_to_typed_proto_fields():
    message = translate.to_proto(
        request(
            model="tiny", size="512x256", n=3, seed=2**63 - 1, negative_prompt="blurry", quality="low",
            output_format="webp", output_compression=0, user="alice", response_format="b64_json",
        ),
        request_id="img-fixed",
    )
    assert message.request_id == "img-fixed"
    assert (message.model, message.width, message.height, message.n) == ("tiny", 512, 256, 3)
    assert message.HasField("seed") and message.seed == 2**63 - 1
    assert message.negative_prompt == "blurry"
    assert message.quality == "low"
    assert message.output_format == common_pb2.OUTPUT_FORMAT_WEBP
    assert message.HasField("output_compression") and message.output_compression == 0
    assert dict(message.knobs) == {}  # user, response_format etc. are not knobs


def test_seed_zero_is_sent():
    message = translate.to_proto(request(seed=0))
    assert message.HasField("seed") and message.seed == 0


def test_extra_fields_become_knobs_with_their_json_types():
    message = translate.to_proto(
        request(text_guidance_scale=4.5, cfg_range=[0.25, 0.5], num_inference_steps=12, top_k=2048, sampler="euler")
    )
    knobs = message.knobs
    assert set(knobs) == {"text_guidance_scale", "cfg_range", "num_inference_steps", "top_k", "sampler"}
    assert knobs["text_guidance_scale"].number_value == 4.5
    assert [v.number_value for v in knobs["cfg_range"].list_value.values] == [0.25, 0.5]
    assert from_value(knobs["num_inference_steps"]) == 12 and isinstance(from_value(knobs["num_inference_steps"]), int)
    assert knobs["sampler"].string_value == "euler"


def test_output_formats_map_to_the_enum():
    for name, enum in (("png", common_pb2.OUTPUT_FORMAT_PNG), ("jpeg", common_pb2.OUTPUT_FORMAT_JPEG),
                       ("webp", common_pb2.OUTPUT_FORMAT_WEBP)):
        assert translate.to_proto(request(output_format=name)).output_format == enum


def completed(**overrides) -> ar_pb2.GenerateImageResponse:
    fields = dict(
        request_id="img-abc", model="tiny", seed=500, width=512, height=256,
        timings=common_pb2.StageTimings(ar_prefill_ms=1.5, ar_decode_ms=20.0, ar_tokens=529, denoise_ms=30.25,
                                        vae_decode_ms=2.0, encode_ms=1.0, total_ms=60.0, transformer_calls=8,
                                        ar_grid_width=32, ar_grid_height=16),
        knobs={"num_inference_steps": to_value(16), "cfg_range": to_value([0.0, 1.0])},
    )
    fields.update(overrides)
    return ar_pb2.GenerateImageResponse(**fields)


def image(index: int, seed: int, data: bytes) -> common_pb2.GeneratedImage:
    return common_pb2.GeneratedImage(index=index, seed=seed, format=common_pb2.OUTPUT_FORMAT_JPEG, data=data,
                                     width=512, height=256)


def test_response_has_openai_shape_with_seeds_and_timings():
    req = request(size="512x256", n=2, seed=500, output_format="jpeg", quality="low")
    # images may arrive out of order: the response follows their index
    body = translate.to_openai(req, [image(1, 501, b"second"), image(0, 500, b"first")], completed(),
                               gateway_ms=1.23456, created=1700000000)
    assert body == {
        "created": 1700000000,
        "data": [
            {"b64_json": base64.b64encode(b"first").decode(), "revised_prompt": None, "seed": 500},
            {"b64_json": base64.b64encode(b"second").decode(), "revised_prompt": None, "seed": 501},
        ],
        "output_format": "jpeg",
        "size": "512x256",
        "quality": "low",
        "background": "opaque",
        "usage": None,
        "request_id": "img-abc",
        "model": "tiny",
        "seed": 500,
        "seeds": [500, 501],
        "timings": {
            "ar_prefill_ms": 1.5, "ar_decode_ms": 20.0, "ar_tokens": 529, "condition_transfer_ms": 0.0,
            "dit_queue_ms": 0.0, "denoise_ms": 30.25, "vae_decode_ms": 2.0, "encode_ms": 1.0, "total_ms": 60.0,
            "transformer_calls": 8, "preview_ms": 0.0, "dit_steps_computed": 0, "dit_steps_skipped": 0, "ar_forwards": 0,
            "ar_grid_width": 32, "ar_grid_height": 16, "gateway_ms": 1.235,
        },
        "knobs": {"num_inference_steps": 16, "cfg_range": [0, 1]},
        "ignored_fields": [],
    }
    assert isinstance(body["timings"]["ar_tokens"], int)


def test_model_card_translation():
    card = ar_pb2.ModelCard(
        id="tiny", family="mammothmoda2", default_width=256, default_height=128, max_side=512, size_multiple=16,
        max_prompt_tokens=1024, quality_steps={"low": 16}, grid=ar_pb2.GridRule(rule="token_budget", tokens=1024),
        knobs=[
            ar_pb2.KnobSpec(name="num_inference_steps", type="int", default=to_value(50), minimum=1, maximum=200,
                            description="steps"),
            ar_pb2.KnobSpec(name="top_p", type="float", minimum=0.0, maximum=1.0),
            ar_pb2.KnobSpec(name="mode", type="string", choices=["a", "b"]),
        ],
    )
    body = translate.models_to_openai(ar_pb2.ListModelsResponse(models=[card]))
    assert body["object"] == "list"
    (model,) = body["data"]
    assert {k: model[k] for k in ("id", "object", "created", "owned_by")} == {
        "id": "tiny", "object": "model", "created": 0, "owned_by": "ardit"}
    ardit = model["ardit"]
    assert ardit["family"] == "mammothmoda2" and ardit["default_size"] == "256x128"
    assert (ardit["max_side"], ardit["size_multiple"], ardit["max_prompt_tokens"]) == (512, 16, 1024)
    assert ardit["quality_steps"] == {"low": 16}
    assert ardit["grid"] == {"rule": "token_budget", "tokens": 1024}
    steps, top_p, mode = ardit["knobs"]
    assert steps == {"name": "num_inference_steps", "type": "int", "default": 50, "minimum": 1, "maximum": 200,
                     "choices": None, "description": "steps"}
    assert top_p["default"] is None and top_p["minimum"] == 0 and top_p["maximum"] == 1
    assert mode["choices"] == ["a", "b"] and mode["minimum"] is None


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailers=()):
        self._code, self._details, self._trailers = code, details, trailers

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers


@pytest.mark.parametrize(
    "code, status, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.CANCELLED, 499, "request_cancelled"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_grpc_status_maps_to_http(code, status, kind):
    error = errors.from_rpc_error(FakeRpcError(code, "nope", ((PARAM_METADATA_KEY, "size"),)), "127.0.0.1:1")
    body = error.response()
    assert error.status == status and body.status_code == status
    assert error.param == "size"
    assert errors.error_body(error.message, status)["error"]["type"] == kind
    if status == 429:
        assert error.headers == {"Retry-After": "1"}


def test_unavailable_message_names_the_stage():
    ar_down = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect"), "ar:50051")
    assert "ar_service at ar:50051 is unavailable" in ar_down.message
    dit_down = errors.from_rpc_error(
        FakeRpcError(grpc.StatusCode.UNAVAILABLE, "dit_service is unavailable: connection refused"), "ar:50051"
    )
    assert dit_down.message == "dit_service is unavailable: connection refused"


def test_model_card_grid_rule_names_its_own_parameter():
    def grid(**fields):
        card = ar_pb2.ModelCard(id="m", **fields)
        return translate.models_to_openai(ar_pb2.ListModelsResponse(models=[card]))["data"][0]["ardit"]["grid"]

    assert grid(grid=ar_pb2.GridRule(rule="pixels_per_token", tokens=1024, pixels_per_token=16)) == {
        "rule": "pixels_per_token", "pixels_per_token": 16}
    assert grid(grid=ar_pb2.GridRule(rule="token_budget", tokens=256, pixels_per_token=16)) == {
        "rule": "token_budget", "tokens": 256}
    assert grid() is None  # a server that does not say
