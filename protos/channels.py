"""gRPC options every ardit server and channel uses.

Condition chunks stay under 4 MiB (see codec.MAX_CHUNK_BYTES), but finished images
travel whole, one per message: a 2048x2048 PNG can take ~12 MiB, and a unary
GenerateImage answer carries all n images. Both sides set the same explicit limit.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def server_options() -> list[tuple[str, int]]:
    return [*_COMMON, ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.min_ping_interval_without_data_ms", 10_000)]


def channel_options() -> list[tuple[str, int]]:
    return [
        *_COMMON,
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]
