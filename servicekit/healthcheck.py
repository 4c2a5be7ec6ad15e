"""``python -m servicekit.healthcheck HOST:PORT``: exit 0 when a gRPC service reports SERVING.

The container health check of ar_service and dit_service (grpc.health.v1, service "").
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, timeout: float = 2.0) -> str:
    """The service's health status name, or "UNREACHABLE"."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m servicekit.healthcheck HOST:PORT", file=sys.stderr)
        return 2
    status = check(args[0])
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
