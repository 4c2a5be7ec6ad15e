"""A private ardit stack on loopback whose processes can be killed, stopped and restarted.

Used by the fault, TLS, replica and fuzz end-to-end tests and by ``bench/fuzz.py`` and ``bench/soak.py``:
each service runs as ``python -m <service> --port ... --model-dir ...`` with stdout and stderr in
``<logs>/<name>.log`` (appended across restarts). Ports are picked once and kept across restarts.

With ``ar_replicas`` / ``dit_replicas`` above 1, each model service runs as that many processes
(``ar_service``, ``ar_service-1``, ...), and the stage in front reaches them through one gRPC target
listing them all (``ipv4:127.0.0.1:P1,127.0.0.1:P2``): gRPC's round_robin and health checking do the rest.

``python -m tools.local_stack --ar-replicas 2 --dit-replicas 2`` runs such a stack in the foreground.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from protos import common_pb2
from servicekit.healthcheck import check
from servicekit.tls import ClientTLS, open_channel

ROOT = Path(__file__).resolve().parents[1]
#: The kinds of process, in start order.
SERVICES = ("dit_service", "ar_service", "gateway")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kind_of(name: str) -> str:
    """``ar_service-1`` -> ``ar_service``."""
    return name.partition("-")[0]


def grpc_target(addresses: list[str]) -> str:
    """One address as it is; several as gRPC's static list (the ipv4: scheme takes comma-separated addresses)."""
    return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)


class LocalStack:
    def __init__(
        self,
        model_dir: Path,
        logs: Path,
        extra: dict[str, list[str]] | None = None,
        env: dict[str, str] | None = None,
        client_tls: dict[str, ClientTLS] | None = None,
        http_headers: dict[str, str] | None = None,
        ar_replicas: int = 1,
        dit_replicas: int = 1,
        gateway_port: int | None = None,
    ):
        if ar_replicas < 1 or dit_replicas < 1:
            raise ValueError("each model service needs at least one replica")
        self.model_dir = Path(model_dir)
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.extra = extra or {}  # flags by kind (every replica) or by name (that replica, after the kind's)
        self.env = env or {}
        self.client_tls = client_tls or {}  # how this harness reaches each gRPC service kind for health checks
        self.http_headers = http_headers or {}
        counts = {"dit_service": dit_replicas, "ar_service": ar_replicas, "gateway": 1}
        self.names = [kind if i == 0 else f"{kind}-{i}" for kind in SERVICES for i in range(counts[kind])]
        self.ports = {name: free_port() for name in self.names}
        if gateway_port is not None:
            self.ports["gateway"] = gateway_port
        self.processes: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()

    # -- addresses ------------------------------------------------------------------------------

    def replicas(self, kind: str) -> list[str]:
        return [name for name in self.names if kind_of(name) == kind]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def ar_address(self) -> str:
        """The first ar_service replica (the only one by default)."""
        return self.address("ar_service")

    @property
    def dit_address(self) -> str:
        """The first dit_service replica (the only one by default)."""
        return self.address("dit_service")

    @property
    def ar_target(self) -> str:
        """The gRPC target the gateway uses: every ar_service replica."""
        return grpc_target([self.address(name) for name in self.replicas("ar_service")])

    @property
    def dit_target(self) -> str:
        """The gRPC target ar_service (and the gateway's health check) uses: every dit_service replica."""
        return grpc_target([self.address(name) for name in self.replicas("dit_service")])

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def log_text(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    # -- processes ------------------------------------------------------------------------------

    def _command(self, name: str) -> list[str]:
        kind = kind_of(name)
        port = str(self.ports[name])
        if kind == "dit_service":
            args = ["--port", port, "--model-dir", str(self.model_dir)]
        elif kind == "ar_service":
            args = ["--port", port, "--model-dir", str(self.model_dir), "--dit-address", self.dit_target]
        else:
            args = ["--port", port, "--ar-address", self.ar_target, "--dit-address", self.dit_target]
        flags = [*self.extra.get(kind, []), *(self.extra.get(name, []) if name != kind else [])]
        return [sys.executable, "-m", kind, *args, *flags]

    def start(self, name: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ARDIT_")}
        env.update({"PYTHONUNBUFFERED": "1", **self.env})
        log = open(self.log_path(name), "a")
        process = subprocess.Popen(self._command(name), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes[name] = process
        self.stopped.discard(name)
        return process

    def ready(self, name: str) -> bool:
        if name == "gateway":
            try:
                return httpx.get(f"{self.gateway_url}/health", timeout=2).status_code in (200, 503)
            except httpx.HTTPError:
                return False
        return check(self.address(name), timeout=2, tls=self.client_tls.get(kind_of(name))) == "SERVING"

    def wait_ready(self, names=None, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.names if names is None else names)
        while pending:
            name = pending[0]
            process = self.processes[name]
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log_text(name)[-4000:]}")
            if self.ready(name):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout} s:\n{self.log_text(name)[-4000:]}")
            time.sleep(0.2)

    def up(self, timeout: float = 180) -> LocalStack:
        for name in self.names:
            self.start(name)
        self.wait_ready(self.names, timeout)
        return self

    def restart(self, name: str, timeout: float = 180) -> None:
        self.start(name)
        self.wait_ready([name], timeout)

    def kill(self, name: str) -> None:
        """SIGKILL: the process dies without any chance to clean up."""
        process = self.processes[name]
        if name in self.stopped:
            process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10)
        self.stopped.discard(name)

    def pause(self, name: str) -> None:
        """SIGSTOP: the process hangs (sockets stay open, nothing answers)."""
        self.processes[name].send_signal(signal.SIGSTOP)
        self.stopped.add(name)

    def resume(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGCONT)
        self.stopped.discard(name)

    def terminate(self, name: str, timeout: float = 30) -> int:
        """SIGTERM and wait; returns the exit code."""
        process = self.processes[name]
        if name in self.stopped:
            self.resume(name)
        process.terminate()
        return process.wait(timeout)

    def down(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for name in reversed(self.names):
            process = self.processes.get(name)
            if process is None:
                continue
            if process.poll() is None:
                if name in self.stopped:
                    process.send_signal(signal.SIGCONT)
                process.terminate()
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait(10)
        return codes

    def __enter__(self) -> LocalStack:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- requests -------------------------------------------------------------------------------

    def generate(self, body: dict, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.gateway_url}/v1/images/generations", json=body, headers=self.http_headers, timeout=timeout)

    def engine_status(self, name: str, timeout: float = 10) -> common_pb2.EngineStatus:
        """GetStatus of one model service replica (queue, running batch, counters)."""
        from protos import ar_pb2_grpc, dit_pb2_grpc

        stub_class = ar_pb2_grpc.ImageGeneratorStub if kind_of(name) == "ar_service" else dit_pb2_grpc.RendererStub
        with open_channel(self.address(name), self.client_tls.get(kind_of(name))) as channel:
            return stub_class(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.local_stack",
        description="Run the gateway and N ar_service and M dit_service replicas on loopback until Ctrl-C.",
    )
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny"), help="pipeline directory (default: models/tiny)")
    parser.add_argument("--ar-replicas", type=int, default=1, help="ar_service processes (default 1)")
    parser.add_argument("--dit-replicas", type=int, default=1, help="dit_service processes (default 1)")
    parser.add_argument("--gateway-port", type=int, default=8000, help="HTTP port of the gateway (default 8000)")
    parser.add_argument("--logs", type=Path, help="directory of the services' logs (default: a new temporary one)")
    args = parser.parse_args(argv)
    if args.ar_replicas < 1 or args.dit_replicas < 1:
        parser.error("--ar-replicas and --dit-replicas must be at least 1")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} holds no model; write the tiny one with: python -m tools.make_tiny {args.model_dir}")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="ardit-stack-"))
    stack = LocalStack(
        args.model_dir, logs, ar_replicas=args.ar_replicas, dit_replicas=args.dit_replicas, gateway_port=args.gateway_port
    )
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        stack.up()
        for name in stack.names:
            where = stack.gateway_url if name == "gateway" else stack.address(name)
            print(f"{name:<16} {where:<28} log {stack.log_path(name)}", flush=True)
        print(f"gateway -> ar_service at {stack.ar_target}; ar_service -> dit_service at {stack.dit_target}; "
              "Ctrl-C stops all", flush=True)
        while not stopping:
            for name, process in stack.processes.items():
                if process.poll() is not None:
                    print(f"{name} exited with code {process.returncode}; stopping the others", flush=True)
                    stopping = True
            time.sleep(0.2)
    finally:
        codes = stack.down()
    return 0 if all(code in (0, -signal.SIGTERM) for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
