"""A private ardit stack on loopback whose processes can be killed, stopped and restarted.

Used by the fault, TLS and fuzz end-to-end tests and by ``bench/fuzz.py`` and ``bench/soak.py``:
each service runs as ``python -m <service> --port ... --model-dir ...`` with stdout and stderr in
``<logs>/<service>.log`` (appended across restarts). Ports are picked once and kept across restarts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from servicekit.healthcheck import check
from servicekit.tls import ClientTLS

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("dit_service", "ar_service", "gateway")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalStack:
    def __init__(
        self,
        model_dir: Path,
        logs: Path,
        extra: dict[str, list[str]] | None = None,
        env: dict[str, str] | None = None,
        client_tls: dict[str, ClientTLS] | None = None,
        http_headers: dict[str, str] | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.extra = extra or {}
        self.env = env or {}
        self.client_tls = client_tls or {}  # how this harness reaches each gRPC service for health checks
        self.http_headers = http_headers or {}
        self.ports = {name: free_port() for name in SERVICES}
        self.processes: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()

    # -- addresses ------------------------------------------------------------------------------

    @property
    def ar_address(self) -> str:
        return f"127.0.0.1:{self.ports['ar_service']}"

    @property
    def dit_address(self) -> str:
        return f"127.0.0.1:{self.ports['dit_service']}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def log_text(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    # -- processes ------------------------------------------------------------------------------

    def _command(self, name: str) -> list[str]:
        port = str(self.ports[name])
        if name == "dit_service":
            args = ["--port", port, "--model-dir", str(self.model_dir)]
        elif name == "ar_service":
            args = ["--port", port, "--model-dir", str(self.model_dir), "--dit-address", self.dit_address]
        else:
            args = ["--port", port, "--ar-address", self.ar_address, "--dit-address", self.dit_address]
        return [sys.executable, "-m", name, *args, *self.extra.get(name, [])]

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
        address = self.dit_address if name == "dit_service" else self.ar_address
        return check(address, timeout=2, tls=self.client_tls.get(name)) == "SERVING"

    def wait_ready(self, names=SERVICES, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        pending = list(names)
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
        for name in SERVICES:
            self.start(name)
        self.wait_ready(SERVICES, timeout)
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
        for name in reversed(SERVICES):
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
