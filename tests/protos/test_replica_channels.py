"""Replicas behind one gRPC target, with ardit's channel and server options and nothing else.

Two in-process servers stand in for two ar_service replicas (ImageGenerator + grpc.health.v1); one
channel reaches both through gRPC's static list target. What a caller would notice: calls spread over
the replicas, a NOT_SERVING or stopped replica gets none, a refusal for load is answered by the other
replica, a call that already got an answer is never run again, a long call outlives its connection's age.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic import ValidationError

from ar_service.settings import ARSettings
from gateway.settings import GatewaySettings
from protos import ar_pb2, ar_pb2_grpc, channels, common_pb2
from protos.status import abort
from tools.local_stack import grpc_target

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Replica(ar_pb2_grpc.ImageGeneratorServicer):
    """Answers StreamImage with one progress event then a summary naming itself; ``mode`` changes that."""

    def __init__(self, name: str, **server_options):
        self.name = name
        self.mode = "ok"
        self.calls = 0
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=channels.server_options(**server_options))
        ar_pb2_grpc.add_ImageGeneratorServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def StreamImage(self, request, context):
        with self.lock:
            self.calls += 1
        if self.mode == "busy":
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.name} is full", retry_after_s=3)
        yield ar_pb2.ImageEvent(progress=common_pb2.Progress(stage="ar_decode", step=1, total=2))
        if self.mode == "dies after answering":
            abort(context, grpc.StatusCode.UNAVAILABLE, f"{self.name} lost its renderer")
        if self.mode == "slow":
            time.sleep(float(request.prompt))
        yield ar_pb2.ImageEvent(completed=ar_pb2.GenerateImageResponse(request_id=request.request_id, model=self.name))


def _stop(replica: Replica) -> None:
    """Stops the server, cancelling its calls, without waiting on it for ever: once, on a loaded CPU, a server that
    had aged out a connection never reported its shutdown as done, and ``stop(None)`` (which waits for that) hung
    the suite. Nothing asserted here depends on the stop."""
    replica.server.stop(0).wait(timeout=10)


@pytest.fixture
def replicas():
    pair = [Replica("a"), Replica("b")]
    yield pair
    for replica in pair:
        _stop(replica)


def _channel(replicas: list[Replica]) -> grpc.Channel:
    return grpc.insecure_channel(grpc_target([r.address for r in replicas]), options=channels.channel_options())


def _answered_by(stub, prompt: str = "") -> str:
    events = list(stub.StreamImage(ar_pb2.GenerateImageRequest(prompt=prompt), timeout=10))
    return events[-1].completed.model


def _serving_all(stub, names: set[str], attempts: int = 50) -> None:
    """Until calls have reached each of ``names`` (a replica's health reaches the channel asynchronously)."""
    seen: set[str] = set()
    for _ in range(attempts):
        seen.add(_answered_by(stub))
        if seen >= names:
            return
        time.sleep(0.05)
    raise AssertionError(f"only {seen} answered, expected {names}")


def test_calls_spread_over_the_replicas_and_skip_one_not_serving(replicas):
    a, b = replicas
    with _channel(replicas) as channel:
        stub = ar_pb2_grpc.ImageGeneratorStub(channel)
        _serving_all(stub, {"a", "b"})
        answers = [_answered_by(stub) for _ in range(8)]
        assert answers.count("a") == answers.count("b") == 4  # round_robin: one each in turn
        a.health.set("", NOT_SERVING)  # loading or draining: the channel watches health and stops picking it
        time.sleep(0.3)
        calls_before = a.calls
        assert {_answered_by(stub) for _ in range(6)} == {"b"}
        assert a.calls == calls_before
        a.health.set("", SERVING)
        _serving_all(stub, {"a", "b"})


def test_a_stopped_replica_leaves_the_rotation(replicas):
    a, b = replicas
    with _channel(replicas) as channel:
        stub = ar_pb2_grpc.ImageGeneratorStub(channel)
        _serving_all(stub, {"a", "b"})
        _stop(b)
        assert {_answered_by(stub) for _ in range(6)} == {"a"}


def test_a_refusal_for_load_is_tried_once_more_on_the_other_replica(replicas):
    a, b = replicas
    with _channel(replicas) as channel:
        stub = ar_pb2_grpc.ImageGeneratorStub(channel)
        _serving_all(stub, {"a", "b"})
        a.mode = "busy"
        assert {_answered_by(stub) for _ in range(6)} == {"b"}  # every call a picked went on to b
        assert a.calls > 0
        b.mode = "busy"
        calls = a.calls + b.calls
        with pytest.raises(grpc.RpcError) as refused:
            _answered_by(stub)
        # Both refused: the caller sees the refusal (with its retry hint) after exactly two attempts.
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing_metadata())["retry-after"] == "3"
        assert a.calls + b.calls == calls + 2


def test_a_call_that_got_an_answer_is_never_run_again(replicas):
    a, b = replicas
    a.mode = b.mode = "dies after answering"
    with _channel(replicas) as channel:
        stub = ar_pb2_grpc.ImageGeneratorStub(channel)
        for _ in range(4):
            calls = a.calls + b.calls
            stream = stub.StreamImage(ar_pb2.GenerateImageRequest(), timeout=10)
            assert next(stream).progress.stage == "ar_decode"
            with pytest.raises(grpc.RpcError) as failed:
                next(stream)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "lost its renderer" in failed.value.details()
            assert a.calls + b.calls == calls + 1


def test_a_dns_target_reaches_every_replica_the_name_resolves_to(replicas):
    a, _ = replicas
    with grpc.insecure_channel(f"dns:///localhost:{a.port}", options=channels.channel_options()) as channel:
        assert _answered_by(ar_pb2_grpc.ImageGeneratorStub(channel)) == "a"


def test_a_call_longer_than_the_connection_age_finishes_and_the_channel_reconnects():
    replica = Replica("aged", max_connection_age_s=0.5, max_connection_age_grace_s=30)
    replica.mode = "slow"
    try:
        with _channel([replica]) as channel:
            stub = ar_pb2_grpc.ImageGeneratorStub(channel)
            assert _answered_by(stub, prompt="2.0") == "aged"  # runs past the age: the grace lets it finish
            for _ in range(3):  # later calls go over new connections
                assert _answered_by(stub, prompt="0.3") == "aged"
    finally:
        _stop(replica)


def test_targets_take_grpc_syntax_and_a_bare_list_is_refused_with_the_fix():
    for target in ("127.0.0.1:50051", "dns:///ar:50051", "ipv4:127.0.0.1:50051,127.0.0.1:50061", "ar:50051"):
        assert GatewaySettings(ar_address=target).ar_address == target
        assert ARSettings(dit_address=target).dit_address == target
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(ar_address="127.0.0.1:50051,127.0.0.1:50061")
    assert "ipv4:127.0.0.1:50051,127.0.0.1:50061" in str(refused.value)
    with pytest.raises(ValidationError):
        ARSettings(dit_address=" ")


def test_server_options_set_the_connection_age_unless_zero():
    options = dict(channels.server_options(max_connection_age_s=300, max_connection_age_grace_s=600))
    assert options["grpc.max_connection_age_ms"] == 300_000 and options["grpc.max_connection_age_grace_ms"] == 600_000
    assert "grpc.max_connection_age_ms" not in dict(channels.server_options(max_connection_age_s=0))
