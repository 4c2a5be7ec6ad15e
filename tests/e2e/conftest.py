"""Starts the three real services as subprocesses on loopback, on the tiny model, once per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from servicekit.healthcheck import check
from tools.make_tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    model_dir: Path
    gateway_url: str
    ar_address: str
    dit_address: str
    logs: Path


def _start(name: str, args: list[str], logs: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env = {key: value for key, value in env.items() if not key.startswith("ARDIT_")}
    log = open(logs / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(what: str, ready, processes: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, process in processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{(logs / f'{name}.log').read_text()[-4000:]}")
        if ready():
            return
        time.sleep(0.25)
    raise RuntimeError(f"{what} not ready after {START_TIMEOUT_S} s")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny"
    make_tiny(directory)
    return directory


@contextmanager
def running_stack(model_dir: Path, logs: Path, dit_model_dir: Path | None = None) -> Iterator[Stack]:
    """The three services on ``model_dir`` (the DiT on ``dit_model_dir`` when given), up and answering SERVING;
    stopped (and their exit checked) on leaving. With another DiT model the gateway need only answer /health (200 or
    503: it reports the pairing's fault once a render has failed)."""
    ar_port, dit_port, gateway_port = free_port(), free_port(), free_port()
    ar, dit = f"127.0.0.1:{ar_port}", f"127.0.0.1:{dit_port}"
    processes = {
        "dit_service": _start(
            "dit_service", ["dit_service", "--port", str(dit_port), "--model-dir", str(dit_model_dir or model_dir)], logs
        ),
        "ar_service": _start(
            "ar_service",
            ["ar_service", "--port", str(ar_port), "--model-dir", str(model_dir), "--dit-address", dit],
            logs,
        ),
        "gateway": _start(
            "gateway", ["gateway", "--port", str(gateway_port), "--ar-address", ar, "--dit-address", dit], logs
        ),
    }
    url = f"http://127.0.0.1:{gateway_port}"

    def gateway_ready() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code in ((200,) if dit_model_dir is None else (200, 503))
        except httpx.HTTPError:
            return False

    try:
        _wait("the services", lambda: check(dit) == "SERVING" and check(ar) == "SERVING" and gateway_ready(), processes, logs)
        yield Stack(model_dir, url, ar, dit, logs)
    finally:
        for process in processes.values():
            process.terminate()
        for name, process in processes.items():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired as exc:
                process.kill()
                raise RuntimeError(f"{name} did not stop within 15 s of SIGTERM") from exc
        for name, process in processes.items():
            assert process.returncode in (0, -15), f"{name} exited with {process.returncode}"


@pytest.fixture(scope="session")
def stack(tiny_model: Path, tmp_path_factory) -> Iterator[Stack]:
    with running_stack(tiny_model, tmp_path_factory.mktemp("logs")) as running:
        yield running


def require_checkpoint(root: Path, writer: str) -> None:
    """A committed checkpoint a test module needs (call at module level): missing, it fails the run under CI=true and
    skips the module elsewhere, saying which command writes one."""
    if not (root / "config.json").is_file():
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"the checkpoint a test needs is missing from {root}")
        pytest.skip(f"no checkpoint in {root} ({writer} writes one)", allow_module_level=True)
