"""A model service whose start fails after its gRPC server is up (the AR engine's warm-up: decode graphs, kernels)
exits non-zero with the reason, instead of living on as a listening process that never serves, while a
gateway keeps asking for its health."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tools.local_stack import ROOT, free_port

# A service that hung would be killed by this timeout and the test would fail on it.
EXIT_TIMEOUT_S = 60


def test_ar_service_exits_when_its_engine_cannot_start(tiny_model: Path):
    # Triton's decode kernels on a CPU, outside Triton's interpreter: the engine refuses them while it builds
    # its fixed-slot decoder, after the server started listening.
    env = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_") and key != "TRITON_INTERPRET"}
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ar_service", "--host", "127.0.0.1", "--port", str(port), "--model-dir",
         str(tiny_model), "--fast-decode", "on", "--decode-kernels", "triton"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    done = threading.Event()

    def ask_health() -> None:  # as the gateway does while the service starts
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not done.is_set():
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                except grpc.RpcError:
                    pass
                done.wait(0.05)

    asker = threading.Thread(target=ask_health, daemon=True)
    asker.start()
    try:
        output, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"ar_service still running {EXIT_TIMEOUT_S} s after its engine failed:\n{output}") from None
    finally:
        done.set()
        asker.join()
    assert process.returncode != 0, output
    assert "kernels='triton' needs" in output, output
