"""A busy dit_service's refusal reaches ar_service's caller with its retry hint, over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from ar_service import events
from ar_service.render_client import GrpcRenderer
from protos import dit_pb2_grpc
from protos.status import abort
from servicekit.checkpoint import open_checkpoint
from tests.ar_service.fake_renderer import serve_renderer
from tests.ar_service.test_ar_batching import make_engine, wait_done


class BusyRenderer(dit_pb2_grpc.RendererServicer):
    def Render(self, request_iterator, context):
        next(request_iterator)  # the header
        abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "dit_service is at capacity", retry_after_s=9)


@pytest.fixture()
def busy_dit():
    with serve_renderer(BusyRenderer()) as address:
        yield address


def test_dit_refusal_keeps_its_code_and_retry_after(tiny_ar, tiny_root, busy_dit):
    renderer = GrpcRenderer(busy_dit)
    engine = make_engine(tiny_ar, open_checkpoint(tiny_root), renderer)
    try:
        job = engine.submit(engine.plan(prompt="a fox", width=64, height=64, seed=1))
        failed = wait_done(job)[-1]
        assert isinstance(failed, events.JobFailed)
        assert failed.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert failed.error.retry_after_s == 9
        assert "at capacity" in failed.error.message
    finally:
        engine.close()
        renderer.close()
