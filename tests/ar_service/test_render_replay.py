"""A Render stream whose replica fails before answering is replayed whole on the other replica; one that got an
answer is never replayed. Real gRPC on loopback; the replica that dies is a process of its own, killed mid-stream."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from ar_service import events
from ar_service.render_client import GrpcRenderer
from protos import common_pb2, dit_pb2, dit_pb2_grpc
from protos.codec import decode_tensor
from protos.status import abort
from tests.ar_service.fake_renderer import render_header, serve_renderer
from tools.local_stack import grpc_target

ROWS = 30  # condition rows each stream sends, one chunk each
HIDDEN = 8


def _row(request_id: str, row: int) -> torch.Tensor:
    """Row ``row`` of a stream's condition: values that say which stream and row they belong to."""
    return torch.full((1, HIDDEN), float(1000 * sum(map(ord, request_id)) + row))


class RecordingRenderer(dit_pb2_grpc.RendererServicer):
    """Keeps, per request id, every message kind and chunk row in arrival order; answers ``completed`` after the
    end marker, or (``fail_after_answer``) a progress event and then UNAVAILABLE."""

    def __init__(self, fail_after_answer: bool = False):
        self.streams: dict[str, list] = {}
        self.calls = 0
        self.fail_after_answer = fail_after_answer
        self.lock = threading.Lock()

    def Render(self, request_iterator, context):
        with self.lock:
            self.calls += 1
        header = next(request_iterator).header
        record = self.streams.setdefault(header.request_id, [])
        record.append("header")
        for message in request_iterator:
            kind = message.WhichOneof("input")
            if kind == "chunk":
                record.append((message.chunk.offset, decode_tensor(message.chunk.hidden_states)))
            else:
                record.append(kind)
        yield dit_pb2.RenderEvent(progress=common_pb2.Progress(stage="condition_received", total=1))
        if self.fail_after_answer:
            abort(context, grpc.StatusCode.UNAVAILABLE, "lost its GPU")
        yield dit_pb2.RenderEvent(completed=dit_pb2.RenderSummary(request_id=header.request_id, seed=header.seed))


class Session:
    """A RenderSession and what reached its callback."""

    def __init__(self, renderer: GrpcRenderer, request_id: str):
        self.request_id = request_id
        self.received: list[object] = []
        self.ended = threading.Event()
        self.session = renderer.open(render_header(request_id, hidden_size=HIDDEN, text_positions=ROWS), self._on_event,
                                     timeout=60)

    def _on_event(self, event) -> None:
        self.received.append(event)
        if isinstance(event, events.RenderDone | events.RenderFailed):
            self.ended.set()

    def send_row(self, row: int) -> None:
        self.session.send_condition("text", row, _row(self.request_id, row))


@pytest.fixture()
def silent_process():
    """A renderer process that takes every stream's input and never answers; its stdout names each header."""
    process = subprocess.Popen([sys.executable, "-m", "tests.ar_service.fake_renderer"], stdout=subprocess.PIPE, text=True)
    address = process.stdout.readline().strip()
    headers: list[str] = []
    reader = threading.Thread(target=lambda: headers.extend(line.strip() for line in process.stdout), daemon=True)
    reader.start()
    yield process, address, headers
    process.kill()
    process.wait()


def test_streams_on_a_killed_replica_are_replayed_whole_on_the_other(silent_process):
    process, silent_address, silent_headers = silent_process
    recorder = RecordingRenderer()
    with serve_renderer(recorder) as live_address:
        renderer = GrpcRenderer(grpc_target([silent_address, live_address]))
        sessions: list[Session] = []
        try:
            # round_robin alternates between the replicas once both are connected: open streams until the silent
            # replica holds two of them.
            while len(silent_headers) < 2:
                assert len(sessions) < 40, "the silent replica never got a stream"
                sessions.append(Session(renderer, f"r{len(sessions)}"))
                time.sleep(0.05)
            for row in range(ROWS):
                if row == ROWS // 2:
                    process.kill()  # mid-stream: half the rows sent, no answer yet
                for s in sessions:
                    s.send_row(row)
                time.sleep(0.005)
            for s in sessions:
                s.session.finish()
            for s in sessions:
                assert s.ended.wait(30), f"{s.request_id}: no end"
        finally:
            renderer.close()

    moved = set(silent_headers)
    for s in sessions:
        failures = [e for e in s.received if isinstance(e, events.RenderFailed)]
        assert not failures, (s.request_id, failures[0].error.message if failures else None)
        assert isinstance(s.received[-1], events.RenderDone)
        record = recorder.streams[s.request_id]
        assert record[0] == "header" and record[-1] == "end", (s.request_id, record[:1], record[-1:])
        rows = record[1:-1]
        assert [offset for offset, _ in rows] == list(range(ROWS)), f"{s.request_id}: rows lost or repeated"
        for offset, tensor in rows:
            assert torch.equal(tensor, _row(s.request_id, offset)), f"{s.request_id}: row {offset} is another's"
        assert s.session.attempts == (2 if s.request_id in moved else 1), s.request_id
    assert len(moved) >= 2


def test_a_stream_that_got_an_answer_is_not_replayed():
    recorder = RecordingRenderer(fail_after_answer=True)
    with serve_renderer(recorder) as address:
        renderer = GrpcRenderer(address)
        try:
            s = Session(renderer, "once")
            s.send_row(0)
            s.session.finish()
            assert s.ended.wait(30)
        finally:
            renderer.close()
    (failed,) = [e for e in s.received if isinstance(e, events.RenderFailed)]
    assert failed.error.code == grpc.StatusCode.UNAVAILABLE and "lost its GPU" in failed.error.message
    assert recorder.calls == 1 and s.session.attempts == 1
