"""The three services as subprocesses on loopback, for the benchmarks: model directory, start, health, stop.

Shared by ``bench.harness`` (the sweep) and ``bench.preview_e2e`` (one request). The Preview-shaped model is a
skeleton directory (configs and tokenizer, no tensors) written by ``tools.make_tiny --preview`` (the Dev-shaped one by
``--dev-skeleton``); the model
services then build bf16 random weights straight on the device (``--random-weights``). ``tiny=True`` uses the
tiny model with its own weights instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from protos import ar_pb2_grpc, common_pb2, dit_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("dit_service", "ar_service", "gateway")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: ``tools.make_tiny``'s flag for each member: the random-weight skeleton, or with ``tiny`` the tiny model.
SKELETON_FLAGS = {"preview": ["--preview"], "dev": ["--dev-skeleton"]}
TINY_FLAGS = {"preview": [], "dev": ["--dev"]}


def make_model_dir(workdir: Path, tiny: bool, member: str = "preview") -> Path:
    """Writes (or rewrites, deterministically) the model directory the services load; returns its path: the
    ``member``'s skeleton (configs and tokenizer; the services build random weights), or its tiny model."""
    model_dir = Path(workdir) / (("tiny" if tiny else "random") + ("" if member == "preview" else f"-{member}"))
    if not tiny and member == "preview":
        model_dir = Path(workdir) / "preview-random"
    flags = (TINY_FLAGS if tiny else SKELETON_FLAGS)[member]
    command = [sys.executable, "-m", "tools.make_tiny", str(model_dir), *flags]
    subprocess.run(command, check=True, cwd=ROOT)
    return model_dir


class GpuMemoryWatch:
    """Polls nvidia-smi for the memory each process holds; keeps the peak per pid, overall and since ``lap()``.

    Without nvidia-smi (a CPU machine) it records nothing and every peak reads as absent.
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.available = shutil.which("nvidia-smi") is not None
        self.interval_s = interval_s
        self.peak_mib: dict[int, int] = {}
        self.lap_peak_mib: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.available:
            self._thread.start()

    def _poll(self) -> None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return
        with self._lock:
            for line in out.strip().splitlines():
                try:
                    pid, used = (int(part.strip()) for part in line.split(","))
                except ValueError:
                    continue
                self.peak_mib[pid] = max(self.peak_mib.get(pid, 0), used)
                self.lap_peak_mib[pid] = max(self.lap_peak_mib.get(pid, 0), used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval_s)

    def lap(self) -> dict[int, int]:
        """Peaks since the previous lap (or the start); starts a new lap."""
        if self.available:
            self._poll()  # one fresh sample, so a short lap is not empty
        with self._lock:
            peaks, self.lap_peak_mib = self.lap_peak_mib, {}
        return peaks

    def stop(self) -> dict[int, int]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak_mib


def wait_healthy(url: str, processes: dict[str, subprocess.Popen], timeout: float) -> float:
    """Seconds until the gateway's /health answers 200 (both model services serving); exits if one dies."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        for name, process in processes.items():
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"services not healthy after {timeout} s")


def status(address: str, stub_class) -> dict:
    """An engine's GetStatus (queue, running batch, counters) as a dict."""
    with grpc.insecure_channel(address) as channel:
        reply = stub_class(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=10)
    return {field.name: getattr(reply, field.name) for field in reply.DESCRIPTOR.fields}


@dataclass
class ServiceStack:
    """dit_service, ar_service and the gateway on free loopback ports, each logging to ``logs/<name>.log``."""

    model_dir: Path
    logs: Path
    device: str = "cuda"
    random_weights: bool = True
    request_timeout_s: float = 3600.0
    extra_ar: list[str] = field(default_factory=list)
    extra_dit: list[str] = field(default_factory=list)
    env_ar: dict[str, str] = field(default_factory=dict)
    env_dit: dict[str, str] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ar_port, dit_port, gateway_port = free_port(), free_port(), free_port()
        self.ar_address, self.dit_address = f"127.0.0.1:{ar_port}", f"127.0.0.1:{dit_port}"
        self.url = f"http://127.0.0.1:{gateway_port}"
        common = ["--model-dir", str(self.model_dir), "--device", self.device]
        common += ["--random-weights"] if self.random_weights else []
        self.commands = {
            "dit_service": ["dit_service", "--port", str(dit_port), *common, *self.extra_dit],
            "ar_service": ["ar_service", "--port", str(ar_port), "--dit-address", self.dit_address, *common,
                           *self.extra_ar],
            "gateway": ["gateway", "--port", str(gateway_port), "--ar-address", self.ar_address, "--dit-address",
                        self.dit_address, "--request-timeout-s", str(int(self.request_timeout_s))],
        }

    def environment(self, name: str) -> dict[str, str]:
        """The environment one service starts with: this process's, plus that service's own variables."""
        own = {"ar_service": self.env_ar, "dit_service": self.env_dit}.get(name, {})
        return {**os.environ, "PYTHONUNBUFFERED": "1", **own}

    def start(self, timeout_s: float = 900.0) -> float:
        """Starts the three processes and waits until the gateway reports both services serving; returns seconds."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for name, command in self.commands.items():
            log = open(self.logs / f"{name}.log", "w")
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", *command], cwd=ROOT, env=self.environment(name), stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()  # the child holds its own descriptor
        try:
            return wait_healthy(self.url, self.processes, timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> dict[str, int]:
        return {name: process.pid for name, process in self.processes.items()}

    def engine_status(self) -> dict[str, dict]:
        return {"ar": status(self.ar_address, ar_pb2_grpc.ImageGeneratorStub),
                "dit": status(self.dit_address, dit_pb2_grpc.RendererStub)}

    def log_lines(self, name: str, *needles: str) -> list[str]:
        path = self.logs / f"{name}.log"
        if not path.is_file():
            return []
        return [line for line in path.read_text().splitlines() if any(n in line for n in needles)]

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to each process this stack started, then SIGKILL to any still alive after ``grace_s``."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
