"""gRPC options every ardit server and channel uses.

Condition chunks stay under 4 MiB (see codec.MAX_CHUNK_BYTES), but finished images
travel whole, one per message: a 2048x2048 PNG can take ~12 MiB, and a unary
GenerateImage answer carries all n images. Both sides set the same explicit limit.

Replicas are gRPC's business, not ardit's: a channel's target may name several replicas
(``dns:///ar:50051``, ``ipv4:10.0.0.1:50051,10.0.0.2:50051``, or one ``host:port``), the
``round_robin`` policy gives each call (a request, a Render stream) the next ready replica, and
client-side health checking (``healthCheckConfig``: the channel watches each replica's
grpc.health.v1 status) keeps NOT_SERVING replicas (loading, draining) out of the rotation.
Servers end each connection after ``max_connection_age`` so that clients resolve names again
and find replicas that came or went.
"""

from __future__ import annotations

import json

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

#: Default cap on concurrent HTTP/2 streams one client connection may open (a server setting).
DEFAULT_MAX_CONCURRENT_STREAMS = 256

#: gRPC's retry policy: a call refused for load (RESOURCE_EXHAUSTED) or failing before it reached a live
#: server (UNAVAILABLE) is tried once more, and round_robin gives the second attempt the next replica. gRPC
#: retries a call only until it is committed (the first response arrived, or more than the retry buffer was
#: sent), so an answer is never given twice, and work in flight on a replica that dies fails instead of
#: running again. Jittered backoff of at most 0.1 s before the second attempt. ar_service's Render streams
#: do not use it (their channel has ``retries=False``): ar_service.render_client replays them itself, by the
#: same rules (these three values).
RETRY_ATTEMPTS = 2
RETRYABLE_STATUS_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
RETRY_BACKOFF_S = 0.1
RETRY_POLICY = {
    "maxAttempts": RETRY_ATTEMPTS,
    "initialBackoff": f"{RETRY_BACKOFF_S}s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": list(RETRYABLE_STATUS_CODES),
}
RETRIED_SERVICES = ("ardit.v1.ImageGenerator", "ardit.v1.Renderer", "grpc.health.v1.Health")
#: Every call picks the next ready replica of the target (one address: always that one).
LOAD_BALANCING: list[dict[str, dict]] = [{"round_robin": {}}]
#: The grpc.health.v1 service name each replica is watched on ("" = the whole server, as probes use).
HEALTH_CHECKED_SERVICE = ""

#: Servers close each connection after this long (GOAWAY; the client reconnects and re-resolves its target).
DEFAULT_MAX_CONNECTION_AGE_S = 300.0
#: Calls still running on a connection past its age get this long to finish before it is closed.
DEFAULT_MAX_CONNECTION_AGE_GRACE_S = 600.0


def service_config(health_checked: bool = True) -> str:
    """The channels' service config: round_robin, retries, and (by default) client-side health checking."""
    config: dict = {
        "loadBalancingConfig": LOAD_BALANCING,
        "methodConfig": [{"name": [{"service": name} for name in RETRIED_SERVICES], "retryPolicy": RETRY_POLICY}],
    }
    if health_checked:
        config["healthCheckConfig"] = {"serviceName": HEALTH_CHECKED_SERVICE}
    return json.dumps(config)


def check_target(target: str) -> str:
    """A gRPC target as given, or a ValueError saying how to write a list of replicas.

    gRPC parses targets itself (``dns:///name:port``, ``ipv4:a:port,b:port``, ``ipv6:``, ``unix:``, ``host:port``);
    the one mistake caught here is a bare comma-separated list, which gRPC would take for one host name.
    """
    target = target.strip()
    if not target:
        raise ValueError("a gRPC target is empty; give host:port, dns:///name:port or ipv4:host:port,host:port")
    if "," in target and not target.startswith(("ipv4:", "ipv6:")):
        raise ValueError(
            f"{target!r}: a list of replicas needs gRPC's ipv4: or ipv6: scheme, e.g. "
            f"'ipv4:{target}'; or one name for all of them, e.g. 'dns:///ar:50051'"
        )
    return target


_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def server_options(
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
    max_receive_message_bytes: int = MAX_MESSAGE_BYTES,
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S,
    max_connection_age_grace_s: float = DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
) -> list[tuple[str, int]]:
    """Options of every ardit gRPC server; ``max_concurrent_streams`` caps streams per client connection,
    ``max_connection_age_s`` (0 = never) makes clients reconnect, and so re-resolve, that often."""
    options = [
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
    if max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000)),
        ]
    return options


def channel_options(health_checked: bool = True, retries: bool = True) -> list[tuple[str, int | str]]:
    """Options of every ardit channel: keepalive, reconnect backoff, round_robin over the target's replicas,
    the retry policy and (unless ``health_checked`` is False: a probe that must reach NOT_SERVING replicas too)
    client-side health checking.

    ``retries=False`` turns gRPC's retries off, transparent ones included: for client-streaming calls (Render),
    whose caller replays the stream itself; a client stream that gRPC retried was seen to arrive with messages
    missing (grpcio 1.85, a replica killed mid-stream).
    """
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
        ("grpc.enable_retries", 1 if retries else 0),
        ("grpc.service_config", service_config(health_checked)),
    ]
