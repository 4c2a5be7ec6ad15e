"""Channel and server options: keepalive, reconnect backoff, retry policy, stream cap."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import channels


def test_channels_balance_over_replicas_health_check_them_and_retry_refusals_once():
    options = dict(channels.channel_options())
    config = json.loads(options["grpc.service_config"])
    (method,) = config["methodConfig"]
    assert {name["service"] for name in method["name"]} == {"ardit.v1.ImageGenerator", "ardit.v1.Renderer", "grpc.health.v1.Health"}
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE", "RESOURCE_EXHAUSTED"]
    assert method["retryPolicy"]["maxAttempts"] == 2
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ""}
    assert "healthCheckConfig" not in json.loads(dict(channels.channel_options(health_checked=False))["grpc.service_config"])
    assert options["grpc.enable_retries"] == 1
    assert dict(channels.channel_options(retries=False))["grpc.enable_retries"] == 0  # the Render channel replays itself
    assert options["grpc.keepalive_time_ms"] > 0 and options["grpc.max_reconnect_backoff_ms"] <= 1000


def test_server_options_carry_the_stream_cap_and_receive_limit():
    options = dict(channels.server_options(max_concurrent_streams=7, max_receive_message_bytes=1234))
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.max_receive_message_length"] == 1234


def test_a_channel_with_the_options_works_against_a_server_with_them():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=channels.server_options())
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=channels.channel_options()) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)
