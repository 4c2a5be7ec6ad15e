"""``python -m servicekit.healthcheck HOST:PORT``: exit 0 when a gRPC service reports SERVING.

The container health check of ar_service and dit_service (grpc.health.v1, service "").
Over TLS: ``--tls-ca FILE`` (and ``--tls-cert FILE --tls-key FILE`` under mutual TLS,
``--tls-server-name NAME`` when the address is not a name the certificate holds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.tls import ClientTLS, open_channel


def check(address: str, timeout: float = 2.0, tls: ClientTLS | None = None) -> str:
    """The service's health status name, or "UNREACHABLE"."""
    with open_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servicekit.healthcheck", description="gRPC health check")
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA of the server's certificate (turns TLS on)")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name to verify the server's certificate against")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    status = check(args.address, args.timeout, tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
