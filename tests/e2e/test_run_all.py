"""`make up`'s launcher: one command starts all three services, restarts one that dies, Ctrl-C stops all three."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tools.local_stack import ROOT, free_port
from tools.run_all import RestartPolicy

START_TIMEOUT_S = 180
# Serving again within 30 s of the crash, nothing done by hand; on a machine so loaded that the stack's first
# start took longer than that, a restart gets as long as that first start took (it cannot be quicker).
RECOVERY_TIMEOUT_S = 30


class Launcher:
    """``python -m tools.run_all`` as a subprocess on free ports; its console (and its children's) read line by line."""

    def __init__(self, model_dir: Path, *extra: str, dit_port: int | None = None):
        self.ports = {"gateway": free_port(), "ar_service": free_port(), "dit_service": dit_port or free_port()}
        self.url = f"http://127.0.0.1:{self.ports['gateway']}"
        clean = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tools.run_all", "--model-dir", str(model_dir), "--gateway-port", str(self.ports["gateway"]),
             "--ar-port", str(self.ports["ar_service"]), "--dit-port", str(self.ports["dit_service"]), *extra],
            cwd=ROOT, env={**clean, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def pids(self, name: str) -> list[int]:
        """Every pid the launcher reported for ``name``, oldest first."""
        return [int(match[1]) for line in list(self.lines) if (match := re.fullmatch(rf"ardit: {name} started \(pid (\d+)\)", line))]

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self) -> float:
        """Seconds until the whole stack answered healthy."""
        started = time.monotonic()
        while self.health() != 200:
            assert self.process.poll() is None, self.output
            assert time.monotonic() < started + START_TIMEOUT_S, f"not healthy after {START_TIMEOUT_S} s:\n{self.output}"
            time.sleep(0.5)
        return time.monotonic() - started

    def generate(self, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/images/generations", json={"prompt": "a kite", "num_inference_steps": 2}, timeout=timeout)

    def interrupt(self) -> int:
        """Ctrl-C; returns the launcher's exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=60)
        self.reader.join(timeout=10)
        return code

    def assert_all_stopped(self) -> None:
        for name in self.ports:
            for pid in self.pids(name):
                assert not alive(pid), f"{name} (pid {pid}) still running:\n{self.output}"
        for port in self.ports.values():
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served:\n{self.output}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launcher_serves_an_image_and_ctrl_c_stops_everything(tiny_model):
    launcher = Launcher(tiny_model)
    try:
        launcher.wait_healthy()
        response = launcher.generate()
        assert response.status_code == 200, response.text
    finally:
        code = launcher.interrupt()
    assert code == 0, launcher.output
    launcher.assert_all_stopped()


def test_a_killed_dit_is_restarted_while_the_others_keep_running(tiny_model):
    launcher = Launcher(tiny_model)
    try:
        recovery_s = max(RECOVERY_TIMEOUT_S, launcher.wait_healthy() + 5)
        (dit_pid,) = launcher.pids("dit_service")
        (ar_pid,), (gateway_pid,) = launcher.pids("ar_service"), launcher.pids("gateway")
        os.kill(dit_pid, signal.SIGKILL)
        killed = time.monotonic()

        # meanwhile the gateway is up and says the pipeline is unavailable
        deadline = killed + recovery_s
        statuses = []
        while 503 not in statuses and time.monotonic() < deadline:
            statuses.append(launcher.health())
            time.sleep(0.2)
        assert 503 in statuses, f"{statuses}\n{launcher.output}"
        refused = launcher.generate()
        assert refused.status_code == 503, refused.text

        # and serves again, with nothing done by hand (health polls are cheap: the restarting DiT keeps the CPU)
        while launcher.health() != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        response = None
        while time.monotonic() < deadline:
            try:
                response = launcher.generate(timeout=max(1.0, deadline - time.monotonic()))
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 200:
                break
            time.sleep(0.5)
        assert response is not None and response.status_code == 200, f"not serving {recovery_s:.0f} s after the crash:\n{launcher.output}"
        print(f"serving again {time.monotonic() - killed:.1f} s after the crash")

        assert "ardit: dit_service was killed by SIGKILL; restarting it in 1 s (the others keep running)" in launcher.lines
        new_dit_pids = launcher.pids("dit_service")[1:]
        assert len(new_dit_pids) == 1 and alive(new_dit_pids[0]), launcher.output
        assert launcher.pids("ar_service") == [ar_pid] and launcher.pids("gateway") == [gateway_pid], launcher.output
        assert alive(ar_pid) and alive(gateway_pid)
    finally:
        code = launcher.interrupt()
    assert code == 0, launcher.output
    launcher.assert_all_stopped()


def test_a_service_that_keeps_crashing_is_given_up_on_and_everything_stops(tiny_model):
    with socket.socket() as taken:  # something else holds dit_service's port: it refuses to start, each time
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        launcher = Launcher(tiny_model, "--max-crashes", "2", dit_port=taken.getsockname()[1])
        try:
            code = launcher.process.wait(timeout=START_TIMEOUT_S)
        finally:
            launcher.interrupt()
    assert code == 1, launcher.output
    assert len(launcher.pids("dit_service")) == 2, launcher.output
    assert "ardit: dit_service exited with code 1; restarting it in 1 s (the others keep running)" in launcher.lines
    assert "ardit: dit_service exited with code 1: 2 exits within 60 s; giving up and stopping everything" in launcher.lines
    for pid in launcher.pids("ar_service") + launcher.pids("gateway"):
        assert not alive(pid), launcher.output


def test_restart_backoff_doubles_to_a_cap_and_forgets_exits_older_than_the_window():
    policy = RestartPolicy(max_crashes=7, window_s=60)
    assert [policy.after_exit(now) for now in range(6)] == [1, 2, 4, 8, 16, 16]
    assert policy.after_exit(6) is None  # the 7th exit within 60 s
    assert RestartPolicy(max_crashes=2, window_s=60).after_exit(0) == 1
    spaced = RestartPolicy(max_crashes=2, window_s=60)
    assert [spaced.after_exit(now) for now in (0, 61, 122)] == [1, 1, 1]  # one exit a minute: never given up on
