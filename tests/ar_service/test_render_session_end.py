"""A render that finished stays finished: the AR's clean-up after the request never turns the renderer's OK
into a cancelled call (which the render's trace span and the renderer's logs would report as a failure)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ar_service import events
from ar_service.render_client import GrpcRenderer
from protos import dit_pb2, dit_pb2_grpc
from tests.ar_service.fake_renderer import render_header, serve_renderer

SLOW_CLOSE_S = 1.0


class SlowToCloseRenderer(dit_pb2_grpc.RendererServicer):
    """Reads the whole input, reports completion, then takes a moment before the call's OK status goes out (as a
    loaded renderer does between its last message and the end of its handler)."""

    def Render(self, request_iterator, context):
        header = next(request_iterator).header
        for message in request_iterator:
            if message.WhichOneof("input") == "end":
                break
        yield dit_pb2.RenderEvent(completed=dit_pb2.RenderSummary(request_id=header.request_id, seed=header.seed))
        time.sleep(SLOW_CLOSE_S)


@pytest.fixture()
def slow_dit():
    with serve_renderer(SlowToCloseRenderer()) as address:
        yield address


def test_cancel_after_completion_leaves_the_call_ok(slow_dit):
    renderer = GrpcRenderer(slow_dit)
    done = threading.Event()
    received: list[object] = []

    def on_event(event):
        received.append(event)
        if isinstance(event, events.RenderDone):
            done.set()

    try:
        session = renderer.open(render_header("r1"), on_event, timeout=30)
        session.finish()
        assert done.wait(10)
        session.cancel()  # what the engine does to every session once the request's RPC has ended
        session._reader.join(SLOW_CLOSE_S + 10)
        assert session._call.code() == grpc.StatusCode.OK
        assert not [e for e in received if isinstance(e, events.RenderFailed)]
    finally:
        renderer.close()
