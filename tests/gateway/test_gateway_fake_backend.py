"""The gateway against a stand-in ImageGenerator that records what it receives.

The end-to-end suite (tests/e2e) drives the real services; this one checks what the gateway puts on
the wire field by field, and statuses the real services cannot be made to answer on demand yet
(RESOURCE_EXHAUSTED, an AR that hangs until the client leaves)."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.settings import GatewaySettings
from protos import ar_pb2, ar_pb2_grpc, channels, common_pb2
from protos.status import abort
from protos.values import knobs_from_proto, knobs_to_proto, to_value

ROOT = Path(__file__).resolve().parents[2]
URL = "/v1/images/generations"


class FakeGenerator(ar_pb2_grpc.ImageGeneratorServicer):
    def __init__(self):
        self.requests: list[ar_pb2.GenerateImageRequest] = []
        self.cancelled = threading.Event()

    def StreamImage(self, request, context):
        self.requests.append(request)
        if request.prompt == "slow":
            context.add_callback(self.cancelled.set)
            deadline = time.monotonic() + 10
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.02)
            return
        knobs = knobs_from_proto(request.knobs)
        if "guidance" in knobs:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  "unknown parameter 'guidance'; accepted parameters: text_guidance_scale", "guidance")
        if request.prompt == "busy":
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if request.prompt == "dit down":
            abort(context, grpc.StatusCode.UNAVAILABLE, "dit_service is unavailable: connection refused")
        if request.model not in ("", "fake"):
            abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.model!r} not found; served: fake", "model")
        seed = request.seed if request.HasField("seed") else 77
        width, height = request.width or 64, request.height or 32
        n = request.n or 1
        yield ar_pb2.ImageEvent(progress=common_pb2.Progress(index=0, stage="ar_decode", step=1, total=2))
        for index in reversed(range(n)):  # out of order on purpose
            yield ar_pb2.ImageEvent(image=common_pb2.GeneratedImage(
                index=index, seed=seed + index, format=request.output_format, data=f"img{index}".encode(),
                width=width, height=height))
        yield ar_pb2.ImageEvent(completed=ar_pb2.GenerateImageResponse(
            request_id=request.request_id, model="fake", seed=seed, width=width, height=height,
            timings=common_pb2.StageTimings(ar_decode_ms=5.0, denoise_ms=7.0, total_ms=13.0, ar_tokens=9,
                                            transformer_calls=4),
            knobs=knobs_to_proto({"num_inference_steps": 16 if request.quality == "low" else 50, **knobs}),
        ))

    def ListModels(self, request, context):
        return ar_pb2.ListModelsResponse(models=[ar_pb2.ModelCard(
            id="fake", family="mammothmoda2", default_width=64, default_height=32, max_side=512, size_multiple=16,
            max_prompt_tokens=128, quality_steps={"low": 16},
            knobs=[ar_pb2.KnobSpec(name="num_inference_steps", type="int", default=to_value(50), minimum=1, maximum=200)],
        )])


def start_fake_backend(servicer) -> tuple[grpc.Server, str, health.HealthServicer]:
    """A real gRPC server on loopback with ``servicer`` as its ImageGenerator and a SERVING health service."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=channels.server_options())
    ar_pb2_grpc.add_ImageGeneratorServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", health_servicer


@pytest.fixture(scope="module")
def backend():
    generator = FakeGenerator()
    server, address, health_servicer = start_fake_backend(generator)
    yield address, generator, health_servicer
    server.stop(grace=None)


@pytest.fixture(scope="module")
def client(backend):
    address, _, _ = backend
    # the fake serves both ImageGenerator and the health service: it stands in for ar and dit
    settings = GatewaySettings(ar_address=address, dit_address=address, request_timeout_s=10.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def test_generation_returns_openai_shape_with_extras(client, backend):
    _, generator, _ = backend
    response = client.post(URL, json={"prompt": "a fox", "n": 2, "size": "256x128", "seed": 500, "quality": "low",
                                      "output_format": "jpeg", "output_compression": 80, "negative_prompt": "blur",
                                      "text_guidance_scale": 4.0, "cfg_range": [0.25, 0.5], "user": "alice"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"created", "data", "output_format", "size", "quality", "background", "usage",
                         "request_id", "model", "seed", "seeds", "timings", "knobs", "ignored_fields"}
    assert body["ignored_fields"] == [] and "x-ardit-ignored-fields" not in response.headers
    assert [base64.b64decode(item["b64_json"]) for item in body["data"]] == [b"img0", b"img1"]
    assert [item["seed"] for item in body["data"]] == [500, 501] == body["seeds"]
    assert all(item["revised_prompt"] is None for item in body["data"])
    assert (body["seed"], body["model"], body["size"], body["output_format"]) == (500, "fake", "256x128", "jpeg")
    assert (body["quality"], body["background"], body["usage"]) == ("low", "opaque", None)
    assert body["timings"]["denoise_ms"] == 7.0 and body["timings"]["transformer_calls"] == 4
    assert body["timings"]["gateway_ms"] >= 0
    assert body["knobs"]["num_inference_steps"] == 16
    assert abs(time.time() - body["created"]) < 60
    assert response.headers["x-request-id"] == body["request_id"]
    sent = generator.requests[-1]
    assert sent.request_id == body["request_id"] and sent.request_id.startswith("img-")
    assert (sent.width, sent.height, sent.n, sent.seed, sent.negative_prompt) == (256, 128, 2, 500, "blur")
    assert sent.output_compression == 80 and sent.output_format == common_pb2.OUTPUT_FORMAT_JPEG
    assert knobs_from_proto(sent.knobs) == {"text_guidance_scale": 4, "cfg_range": [0.25, 0.5]}


def test_openai_client_works(backend, client):
    from openai import OpenAI

    openai_client = OpenAI(base_url=f"{client.base_url}/v1", api_key="x", max_retries=0, http_client=client)
    result = openai_client.images.generate(prompt="a lighthouse", size="256x256", response_format="b64_json",
                                           extra_body={"seed": 11, "num_inference_steps": 4})
    assert base64.b64decode(result.data[0].b64_json) == b"img0"
    assert result.model_extra["seed"] == 11 and result.model_extra["seeds"] == [11]


def test_every_openai_field_in_one_request_is_answered_naming_those_without_effect(backend, client):
    """The official client with every parameter of images.generate set (openai-python 3.63): a 200, whose
    ignored_fields and X-Ardit-Ignored-Fields header name the fields that changed nothing here."""
    from openai import OpenAI

    _, generator, _ = backend
    openai_client = OpenAI(base_url=f"{client.base_url}/v1", api_key="x", max_retries=0, http_client=client)
    raw = openai_client.images.with_raw_response.generate(
        prompt="a lighthouse", model="fake", n=2, size="256x128", quality="low", response_format="b64_json",
        output_format="webp", output_compression=60, background="opaque", moderation="low", style="vivid",
        complexity="high", frame_count=4, frame_duration_ms=100, svg={"model": "any", "reasoning": {"effort": "low"}},
        partial_images=2, stream=False, user="alice", safety_identifier="hash-1",
    )
    ignored = ["complexity", "frame_count", "frame_duration_ms", "moderation", "partial_images", "style", "svg"]
    assert raw.headers["x-ardit-ignored-fields"] == ", ".join(ignored)
    result = raw.parse()
    assert result.model_extra["ignored_fields"] == ignored
    assert [base64.b64decode(item.b64_json) for item in result.data] == [b"img0", b"img1"]
    assert (result.size, result.quality, result.output_format, result.background) == ("256x128", "low", "webp", "opaque")
    sent = generator.requests[-1]
    assert (sent.quality, sent.output_compression, sent.partial_images, sent.n) == ("low", 60, 0, 2)
    assert knobs_from_proto(sent.knobs) == {}


def test_an_invalid_style_is_a_400_naming_the_accepted_values(backend, client):
    from openai import BadRequestError, OpenAI

    openai_client = OpenAI(base_url=f"{client.base_url}/v1", api_key="x", max_retries=0, http_client=client)
    with pytest.raises(BadRequestError) as refused:
        openai_client.images.generate(prompt="a cat", model="fake", extra_body={"style": "loud"})
    error = refused.value.body
    assert (error["param"], error["code"]) == ("style", "invalid_value")
    assert error["message"] == "'style' must be one of 'vivid', 'natural'; got \"loud\""


@pytest.mark.parametrize(
    "body, status, param, kind, words",
    [
        ({"prompt": "a cat", "guidance": 3.0}, 400, "guidance", "invalid_request_error", "text_guidance_scale"),
        ({"prompt": "a cat", "model": "dall-e-9"}, 404, "model", "invalid_request_error", "fake"),
        ({"prompt": "busy"}, 429, None, "rate_limit_error", "queue full"),
        ({"prompt": "dit down"}, 503, None, "server_error", "dit_service is unavailable"),
    ],
)
def test_service_errors_pass_through(client, body, status, param, kind, words):
    response = client.post(URL, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, kind)
    assert words in error["message"]
    if status == 429:
        assert response.headers["retry-after"] == "1"


def test_models_routes(client):
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == ["fake"]
    model = client.get("/v1/models/fake").json()
    assert model["owned_by"] == "ardit" and model["ardit"]["default_size"] == "64x32"
    assert model["ardit"]["knobs"][0]["minimum"] == 1
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_health_follows_the_services(client, backend):
    _, _, health_servicer = backend
    assert client.get("/health").json() == {"status": "ok", "ar": "SERVING", "dit": "SERVING"}
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json() == {"status": "unavailable", "ar": "NOT_SERVING", "dit": "NOT_SERVING"}
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def test_python_m_gateway_serves_and_stops_on_ctrl_c(backend):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address, generator, _ = backend
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARDIT_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--port", str(port), "--ar-address", address, "--dit-address", address],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert process.poll() is None and time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.05)
        assert response.status_code == 200, response.text
        generated = httpx.post(f"http://127.0.0.1:{port}{URL}", json={"prompt": "secret words", "user": "bob"}, timeout=10)
        assert generated.status_code == 200
        # a client that goes away cancels the gRPC call (and so the AR decode and the denoise)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{port}{URL}", json={"prompt": "slow"}, timeout=0.3)
        assert generator.cancelled.wait(5), "the gRPC call was not cancelled when the client left"
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=15)
    assert process.returncode == 0, output
    assert "Traceback" not in output
    assert "user='bob'" in output and "prompt_chars=12" in output and "secret words" not in output
