"""Every public RPC of both services answers a caller that sets no deadline (grpcurl's default).

The calls below carry no deadline; the test only stops waiting for them after WAIT_S, so that a
regression fails instead of hanging.
"""

from __future__ import annotations

import io
import threading

import grpc
import pytest
from PIL import Image

from protos import ar_pb2, ar_pb2_grpc, common_pb2, dit_pb2_grpc
from tests.e2e.test_grpc_contract import END, FAST, IMAGE, TEXT, chunk, condition, header

WAIT_S = 180


@pytest.fixture(scope="module")
def generator(stack):
    with grpc.insecure_channel(stack.ar_address) as channel:
        yield ar_pb2_grpc.ImageGeneratorStub(channel)


@pytest.fixture(scope="module")
def renderer(stack):
    with grpc.insecure_channel(stack.dit_address) as channel:
        yield dit_pb2_grpc.RendererStub(channel)


def unary(method, request):
    """Calls ``method`` without a deadline and returns its answer."""
    future = method.future(request)
    try:
        return future.result(timeout=WAIT_S)
    except grpc.FutureTimeoutError:
        future.cancel()
        raise AssertionError(f"no answer within {WAIT_S} s") from None


def streamed(call) -> list:
    """Reads a streaming call made without a deadline to its end."""
    watchdog = threading.Timer(WAIT_S, call.cancel)
    watchdog.start()
    try:
        return list(call)
    finally:
        watchdog.cancel()


def test_generate_image_without_deadline(generator):
    reply = unary(generator.GenerateImage, ar_pb2.GenerateImageRequest(prompt="a green square", width=128, height=64, seed=1, knobs=FAST))
    (image,) = reply.images
    assert Image.open(io.BytesIO(image.data)).size == (128, 64)


def test_stream_image_without_deadline(generator):
    events = streamed(generator.StreamImage(ar_pb2.GenerateImageRequest(prompt="a green square", width=64, height=64, seed=2, knobs=FAST)))
    assert [event.WhichOneof("event") for event in events[-2:]] == ["image", "completed"]
    assert Image.open(io.BytesIO(events[-2].image.data)).size == (64, 64)


def test_generate_visual_tokens_without_deadline(generator):
    rows = streamed(generator.GenerateVisualTokens(ar_pb2.GenerateImageRequest(prompt="a green square", width=128, height=64, seed=3)))
    assert [row.row for row in rows] == list(range(4))


def test_list_models_without_deadline(generator):
    (card,) = unary(generator.ListModels, ar_pb2.ListModelsRequest()).models
    assert card.id


def test_ar_get_status_without_deadline(generator):
    status = unary(generator.GetStatus, common_pb2.GetStatusRequest())
    assert status.max_batch_size > 0


def test_render_without_deadline(renderer):
    text, image = condition(2)
    events = streamed(renderer.Render(iter([header(), chunk(TEXT, 0, text), chunk(IMAGE, 0, image), END])))
    images = [event.image for event in events if event.WhichOneof("event") == "image"]
    assert [Image.open(io.BytesIO(i.data)).size for i in images] == [(128, 128)]


def test_dit_get_status_without_deadline(renderer):
    status = unary(renderer.GetStatus, common_pb2.GetStatusRequest())
    assert status.max_batch_size > 0
