"""``stream: true`` over the real stack: the official openai client, the bytes on the wire, disconnects and failures.

Most tests use the session's stack; the ones that kill or pause a service run on this module's own stack, whose
gateway sends a keep-alive comment after 0.2 s without another event.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
from PIL import Image

from protos import ar_pb2, ar_pb2_grpc, common_pb2, dit_pb2_grpc
from protos.values import knobs_to_proto
from tools.local_stack import LocalStack

URL = "/v1/images/generations"
STEPS = 8
SIZE = "256x128"
BODY = {"prompt": "a lighthouse at dusk", "size": SIZE, "num_inference_steps": STEPS}
SLOW = {"prompt": "a slow one", "size": "256x256", "num_inference_steps": 200, "partial_images": 3}


def client_for(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="not-checked", max_retries=0)


def picture(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


def sse(response: httpx.Response) -> Iterator[tuple[str, str, object]]:
    """(kind, name, payload) per SSE block: ("comment", "ardit.progress", {...}), ("comment", "keep-alive", None),
    ("event", "image_generation.completed", {...}), ("data", "", "[DONE]")."""
    event, data = None, []
    for line in response.iter_lines():
        if line.startswith(":"):
            name, _, payload = line[1:].strip().partition(" ")
            yield "comment", name, json.loads(payload) if payload else None
        elif line.startswith("event:"):
            event = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").strip())
        elif not line and data:
            text = "\n".join(data)
            if event is None:
                yield "data", "", text
            else:
                yield "event", event, json.loads(text)
            event, data = None, []


def status(address: str, stub_class) -> common_pb2.EngineStatus:
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=5)


def wait_idle(stack, timeout: float = 60) -> tuple[common_pb2.EngineStatus, common_pb2.EngineStatus]:
    """(ar, dit) status once neither service has anything queued or running (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        ar = status(stack.ar_address, ar_pb2_grpc.ImageGeneratorStub)
        dit = status(stack.dit_address, dit_pb2_grpc.RendererStub)
        if ar.queued + ar.running + dit.queued + dit.running == 0:
            return ar, dit
        assert time.monotonic() < deadline, f"still busy after {timeout} s: ar {ar}, dit {dit}"
        time.sleep(0.05)


# -- the official client ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("partial_images", [0, 3])
@pytest.mark.parametrize("n", [1, 2])
def test_openai_client_gets_partials_then_each_image_the_same_as_unstreamed(stack, partial_images, n):
    client = client_for(stack.gateway_url)
    seed = 40 + 10 * partial_images + n
    events = list(client.images.generate(
        prompt=BODY["prompt"], size=SIZE, n=n, stream=True, partial_images=partial_images,
        extra_body={"num_inference_steps": STEPS, "seed": seed},
    ))
    assert len(events) == n * (partial_images + 1)
    unstreamed = client.images.generate(prompt=BODY["prompt"], size=SIZE, n=n,
                                        extra_body={"num_inference_steps": STEPS, "seed": seed})
    for index in range(n):
        mine = [event for event in events if event.model_extra["image_index"] == index]
        assert [type(event) for event in mine] == [ImageGenPartialImageEvent] * partial_images + [ImageGenCompletedEvent]
        partials, completed = mine[:-1], mine[-1]
        assert [event.partial_image_index for event in partials] == list(range(partial_images))
        assert [event.model_extra["step"] for event in partials] == [2, 4, 6][:partial_images]
        for event in mine:
            assert (event.size, event.quality, event.background, event.output_format) == (SIZE, "auto", "opaque", "png")
            assert isinstance(event.created_at, int) and event.created_at > 0
            image = picture(event.b64_json)
            assert image.format == "PNG" and image.size == (256, 128)
        assert completed.model_extra["seed"] == seed + index
        assert base64.b64decode(completed.b64_json) == base64.b64decode(unstreamed.data[index].b64_json)
        usage = completed.usage
        assert usage.output_tokens == 8 * (16 + 1) + 1  # the grid contract for 256x128: 8 rows of 16 + EOL, + 1
        assert usage.input_tokens == usage.input_tokens_details.text_tokens > 0
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_a_request_refused_before_the_stream_starts_is_an_http_error(stack):
    client = client_for(stack.gateway_url)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(prompt="x", size="256x256", stream=True, extra_body={"guidance": 3.0})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "guidance"


# -- the wire ----------------------------------------------------------------------------------------------------


def test_the_stream_opens_with_the_plan_reports_every_row_and_step_and_ends_with_done(stack):
    body = {**BODY, "stream": True, "partial_images": 2, "n": 2, "seed": 9}
    with httpx.stream("POST", f"{stack.gateway_url}{URL}", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        blocks = list(sse(response))
    kind, name, started = blocks[0]
    assert (kind, name) == ("comment", "ardit.started")
    assert started["seed"] == 9 and started["n"] == 2 and started["size"] == SIZE and started["grid_rows"] == 8
    assert started["knobs"]["num_inference_steps"] == STEPS
    progress = [payload for kind, name, payload in blocks if name == "ardit.progress"]
    for index in (0, 1):
        rows = [p["step"] for p in progress if p["image_index"] == index and p["stage"] == "ar_decode"]
        steps = [p["step"] for p in progress if p["image_index"] == index and p["stage"] == "denoise"]
        assert rows == list(range(1, 9)) and steps == list(range(1, STEPS + 1))
    events = [(name, payload) for kind, name, payload in blocks if kind == "event"]
    assert sorted(name for name, _ in events) == ["image_generation.completed"] * 2 + ["image_generation.partial_image"] * 4
    assert blocks[-1] == ("data", "", "[DONE]")
    kind, name, summary = blocks[-2]
    assert (kind, name) == ("comment", "ardit.completed")
    assert summary["seeds"] == [9, 10] and summary["timings"]["preview_ms"] > 0 and summary["timings"]["denoise_ms"] > 0
    # a partial image comes after the progress of the step it shows
    for position, (_, name, payload) in enumerate(blocks):
        if name == "image_generation.partial_image":
            shown = [p for k, n, p in blocks[:position] if n == "ardit.progress" and p["image_index"] == payload["image_index"]]
            assert shown[-1] == {"image_index": payload["image_index"], "stage": "denoise", "step": payload["step"],
                                 "total": STEPS}


# -- the gRPC contract under it -----------------------------------------------------------------------------------


def test_stream_image_starts_with_the_plan_and_sends_previews_before_the_image(stack):
    request = ar_pb2.GenerateImageRequest(prompt="a boat", seed=5, partial_images=2,
                                          knobs=knobs_to_proto({"num_inference_steps": 6}))
    with grpc.insecure_channel(stack.ar_address) as channel:
        events = list(ar_pb2_grpc.ImageGeneratorStub(channel).StreamImage(request, timeout=120))
    kinds = [event.WhichOneof("event") for event in events]
    assert kinds[0] == "started" and kinds.count("started") == 1
    started = events[0].started
    assert (started.width, started.height, started.n, started.seed) == (256, 256, 1, 5)  # size 0: the model's default
    assert started.grid_rows == 16 and started.image_tokens == 16 * 17 + 1 and started.prompt_tokens > 0
    previews = [event.preview for event in events if event.WhichOneof("event") == "preview"]
    assert [(p.partial_index, p.step, p.total) for p in previews] == [(0, 2, 6), (1, 4, 6)]
    assert kinds.index("image") > kinds.index("preview") and kinds[-1] == "completed"
    assert all(Image.open(io.BytesIO(p.data)).size == (256, 256) for p in previews)


def test_stream_image_refuses_more_than_three_partial_images_naming_them(stack):
    request = ar_pb2.GenerateImageRequest(prompt="a boat", partial_images=4)
    with grpc.insecure_channel(stack.ar_address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(ar_pb2_grpc.ImageGeneratorStub(channel).StreamImage(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(caught.value.trailing_metadata())["ardit-error-param"] == "partial_images"


# -- disconnects -------------------------------------------------------------------------------------------------


def test_a_client_that_leaves_mid_denoise_cancels_the_render(stack):
    _, before = wait_idle(stack)
    with httpx.stream("POST", f"{stack.gateway_url}{URL}", json={**SLOW, "stream": True}, timeout=120) as response:
        for _kind, name, _ in sse(response):
            if name == "image_generation.partial_image":
                break  # 50 of 200 steps done: leave
    ar, dit = wait_idle(stack)
    assert dit.cancelled_total == before.cancelled_total + 1
    assert dit.completed_total == before.completed_total  # it never ran to its end
    assert ar.running == 0


def test_a_client_that_leaves_mid_decode_cancels_the_ar(stack):
    ar_before, dit_before = wait_idle(stack)
    body = {**SLOW, "size": "512x512", "stream": True}
    with httpx.stream("POST", f"{stack.gateway_url}{URL}", json=body, timeout=120) as response:
        for _kind, name, payload in sse(response):
            if name == "ardit.progress":
                assert payload["stage"] == "ar_decode"
                break  # one grid row of 32 decoded: leave
    ar, dit = wait_idle(stack)
    assert ar.cancelled_total == ar_before.cancelled_total + 1
    assert ar.completed_total == ar_before.completed_total
    assert dit.completed_total == dit_before.completed_total


# -- failures and silence, on a stack of this module's own ---------------------------------------------------------


@pytest.fixture(scope="module")
def own_stack(tiny_model, tmp_path_factory):
    stack = LocalStack(tiny_model, tmp_path_factory.mktemp("streaming") / "logs",
                       extra={"gateway": ["--sse-keepalive-s", "0.2"]})
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


def _until_denoising(response: httpx.Response) -> Iterator[tuple[str, str, object]]:
    """The stream's blocks, from the first denoising step on."""
    blocks = sse(response)
    for _kind, name, payload in blocks:
        if name == "ardit.progress" and payload["stage"] == "denoise":
            break
    return blocks


def test_silence_upstream_is_filled_with_keep_alives_and_the_stream_then_completes(own_stack):
    with httpx.stream("POST", f"{own_stack.gateway_url}{URL}", json={**SLOW, "num_inference_steps": 30, "stream": True},
                      timeout=120) as response:
        blocks = _until_denoising(response)
        own_stack.pause("dit_service")
        try:
            keep_alives = 0
            for _kind, name, _ in blocks:
                assert name == "keep-alive" or name == "ardit.progress", name  # nothing else while the DiT hangs
                keep_alives += name == "keep-alive"
                if keep_alives == 3:
                    break
        finally:
            own_stack.resume("dit_service")
        rest = list(blocks)
    assert rest[-1] == ("data", "", "[DONE]")
    assert [name for _, name, _ in rest].count("image_generation.completed") == 1


def test_a_failure_after_the_stream_started_is_an_error_event_not_a_torn_connection(own_stack):
    client = client_for(own_stack.gateway_url)
    stream = client.images.generate(prompt="x", size="256x256", stream=True, partial_images=3,
                                    extra_body={"num_inference_steps": 200, "seed": 1})
    try:
        with pytest.raises(openai.APIError) as caught:
            for event in stream:
                assert event.type == "image_generation.partial_image"
                own_stack.kill("dit_service")  # after the first partial image
    finally:
        stream.close()
        own_stack.restart("dit_service")
    assert type(caught.value) is openai.APIError  # an error event: not APIConnectionError (a torn stream)
    assert "dit_service" in caught.value.message
    assert caught.value.body["type"] == "server_error" and caught.value.body["code"] == "unavailable"
    assert set(caught.value.body) == {"message", "type", "param", "code"}
