"""The caller's deadline, and only the caller's, reaches the DiT: ar_service over real gRPC on loopback,
rendering through a stand-in Renderer that records the deadline each Render call arrives with."""

from __future__ import annotations

import grpc
import pytest

from ar_service.render_client import GrpcRenderer
from ar_service.server import NO_DEADLINE_BEYOND_S, build_server
from protos import ar_pb2, ar_pb2_grpc, dit_pb2_grpc
from protos.status import abort
from servicekit.checkpoint import open_checkpoint
from tests.ar_service.fake_renderer import serve_renderer
from tests.ar_service.test_ar_batching import make_engine


class RecordingRenderer(dit_pb2_grpc.RendererServicer):
    """Records the seconds left on each Render call, then refuses it (the test needs no image)."""

    def __init__(self):
        self.remaining: list[float] = []

    def Render(self, request_iterator, context):
        self.remaining.append(context.time_remaining())
        next(request_iterator)  # the header
        abort(context, grpc.StatusCode.ABORTED, "recorded")


@pytest.fixture()
def recording_dit():
    servicer = RecordingRenderer()
    with serve_renderer(servicer) as address:
        yield servicer, address


@pytest.fixture()
def generator(tiny_ar, tiny_root, recording_dit):
    renderer = GrpcRenderer(recording_dit[1])
    engine = make_engine(tiny_ar, open_checkpoint(tiny_root), renderer)
    running = build_server("127.0.0.1", 0, max_workers=8, engine=engine)
    running.server.start()
    running.set_serving(True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield ar_pb2_grpc.ImageGeneratorStub(channel)
    finally:
        running.server.stop(grace=None)
        engine.close()
        renderer.close()


def generate(generator, **call) -> grpc.RpcError:
    future = generator.GenerateImage.future(ar_pb2.GenerateImageRequest(prompt="a fox", width=64, height=64, seed=1), **call)
    with pytest.raises(grpc.RpcError) as info:
        future.result(timeout=120)
    return info.value


def test_no_deadline_from_the_caller_means_none_on_the_render_call(generator, recording_dit):
    error = generate(generator)
    assert error.code() == grpc.StatusCode.ABORTED, error.details()  # the DiT was reached; no invented deadline
    (remaining,) = recording_dit[0].remaining
    assert remaining > NO_DEADLINE_BEYOND_S


def test_the_callers_deadline_travels_to_the_render_call(generator, recording_dit):
    error = generate(generator, timeout=90)
    assert error.code() == grpc.StatusCode.ABORTED, error.details()
    (remaining,) = recording_dit[0].remaining
    # gRPC's grpc-timeout header may round a deadline up at each hop (to 100 ms steps at this size), so the Render
    # call can see a hair more than the caller's 90 s; what matters is that it is the caller's, not a default.
    assert 60 < remaining <= 90.5
