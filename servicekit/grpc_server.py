"""The gRPC server scaffolding both model services share: options, interceptor, health, reflection, TLS port.

Each service passes its servicer, the function that registers it and its full service name; the result
reports NOT_SERVING until ``set_serving(True)`` (the model loads while the port already answers health).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from servicekit.grpc_guard import MalformedRequestInterceptor
from servicekit.tls import ServerTLS, add_port


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    servicer: Any
    health: health.HealthServicer
    service_name: str

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self.service_name):
            self.health.set(name, status)


def build_grpc_server(
    label: str,
    service_name: str,
    servicer: Any,
    register: Callable[[Any, grpc.Server], None],
    host: str,
    port: int,
    max_workers: int,
    options: list[tuple[str, Any]],
    tls: ServerTLS | None = None,
) -> RunningServer:
    """A bound, not yet started server for ``servicer``, reporting NOT_SERVING."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=options,
        interceptors=[MalformedRequestInterceptor()],
    )
    register(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise SystemExit(f"{label} could not listen on {host}:{port}")
    running = RunningServer(server, bound, servicer, health_servicer, service_name)
    running.set_serving(False)
    return running
