"""`make up`'s launcher: one command starts all three services, Ctrl-C stops all three."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_launcher_serves_an_image_and_ctrl_c_stops_everything(tiny_model):
    gateway, ar, dit = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARDIT_")}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tools.run_all", "--model-dir", str(tiny_model),
         "--gateway-port", str(gateway), "--ar-port", str(ar), "--dit-port", str(dit)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{gateway}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        response = httpx.post(
            f"{url}/v1/images/generations", json={"prompt": "a kite", "num_inference_steps": 2}, timeout=120
        )
        assert response.status_code == 200, response.text
    finally:
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, output
    for port in (gateway, ar, dit):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served after Ctrl-C"
