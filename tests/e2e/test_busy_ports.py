"""A service started on a port that something already listens on refuses at once, before loading its model.

Without the check a model service shared the port with the running instance (gRPC Python sets SO_REUSEPORT),
and the gateway started its app, then failed inside uvicorn with half a dozen log lines.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from dit_service.server import build_server
from tools.local_stack import ROOT, free_port

# A service that did not refuse would load the tiny model and serve: the test then fails on this timeout.
REFUSAL_TIMEOUT_S = 120


@contextmanager
def running_grpc_server() -> Iterator[int]:
    """A gRPC server with gRPC Python's default options (SO_REUSEPORT on), as a running instance would be."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)


@contextmanager
def listening_socket() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def start(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}
    return subprocess.run(
        [sys.executable, "-m", module, "--host", "127.0.0.1", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S,
    )


def assert_refused(result: subprocess.CompletedProcess, label: str, port: int) -> None:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0, output
    # one line, naming the address; nothing else was logged, so no model (and no app) was loaded
    assert output.splitlines() == [f"{label}: 127.0.0.1:{port} is already in use (is another instance running?); not starting"]


@pytest.mark.parametrize("occupy", [running_grpc_server, listening_socket], ids=["grpc-server", "socket"])
@pytest.mark.parametrize("service", ["dit_service", "ar_service"])
def test_model_service_refuses_a_busy_grpc_port_before_loading(service: str, occupy, tiny_model: Path):
    with occupy() as port:
        result = start(service, "--port", str(port), "--model-dir", str(tiny_model))
    assert_refused(result, service, port)


@pytest.mark.parametrize("service", ["dit_service", "ar_service"])
def test_model_service_refuses_a_busy_metrics_port_before_loading(service: str, tiny_model: Path):
    with listening_socket() as metrics_port:
        result = start(service, "--port", str(free_port()), "--metrics-port", str(metrics_port), "--model-dir", str(tiny_model))
    assert_refused(result, service, metrics_port)


def test_gateway_refuses_a_busy_port_before_starting_its_app():
    with listening_socket() as port:
        result = start("gateway", "--port", str(port))
    assert_refused(result, "gateway", port)


def test_grpc_server_does_not_share_a_port_with_a_running_server():
    """The bind itself refuses too (so_reuseport off), for two services that pass the check at the same moment."""
    with running_grpc_server() as port, pytest.raises(SystemExit, match=f"127.0.0.1:{port}"):
        build_server("127.0.0.1", port, max_workers=1)
