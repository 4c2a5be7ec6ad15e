"""gRPC options every ardit server and channel uses.

Condition chunks stay under 4 MiB (see codec.MAX_CHUNK_BYTES), but finished images
travel whole, one per message: a 2048x2048 PNG can take ~12 MiB, and a unary
GenerateImage answer carries all n images. Both sides set the same explicit limit.
"""

from __future__ import annotations

import json

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Default cap on concurrent HTTP/2 streams one client connection may open (a server setting).
DEFAULT_MAX_CONCURRENT_STREAMS = 256

#: Retried transparently by the channel: only UNAVAILABLE (nothing reached a live server), only
#: before the call committed (gRPC semantics: a stream is never retried once a response arrived,
#: nor once more than the retry buffer has been sent), with jittered exponential backoff.
RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
RETRIED_SERVICES = ("ardit.v1.ImageGenerator", "ardit.v1.Renderer", "grpc.health.v1.Health")
SERVICE_CONFIG = json.dumps(
    {"methodConfig": [{"name": [{"service": name} for name in RETRIED_SERVICES], "retryPolicy": RETRY_POLICY}]}
)

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def server_options(
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS, max_receive_message_bytes: int = MAX_MESSAGE_BYTES
) -> list[tuple[str, int]]:
    """Options of every ardit gRPC server; ``max_concurrent_streams`` caps streams per client connection."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        # The server pings idle connections too, so that dead peers are noticed and their calls ended.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        # gRPC Python sets SO_REUSEPORT by default: a second server on a busy port would share it silently.
        ("grpc.so_reuseport", 0),
    ]


def channel_options() -> list[tuple[str, int | str]]:
    """Options of every ardit channel: keepalive, reconnect backoff and the retry policy."""
    return [
        *_COMMON,
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Services restart in seconds: try to reconnect at least once a second, so that the first
        # request after a restart finds the channel connected (or the retry policy covers the gap).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", SERVICE_CONFIG),
    ]
