"""One Preview-shaped image end to end through the three services, with per-stage numbers.

Usage (on a CUDA machine): ``python -m bench.preview_e2e --out DIR [--size 1024 --steps 50]``.
Writes a Preview-shaped checkpoint directory holding configs and tokenizer only, starts
dit_service and ar_service with ``--random-weights`` (bf16, built straight on the GPU) and the
gateway, sends one request, and writes ``DIR/preview_e2e.json`` with the response's stage timings,
each service's load time, parameter counts and peak GPU memory (from nvidia-smi, per process).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GpuMemoryWatch:
    """Polls nvidia-smi for the memory each process holds; keeps the peak per pid."""

    def __init__(self) -> None:
        self.peak_mib: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10,
                ).stdout
                for line in out.strip().splitlines():
                    pid, used = (int(part.strip()) for part in line.split(","))
                    self.peak_mib[pid] = max(self.peak_mib.get(pid, 0), used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(0.5)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak_mib


def wait_healthy(url: str, processes: dict[str, subprocess.Popen], timeout: float) -> float:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preview_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=9.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-preview"), help="where the model directory goes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="dry run with the tiny model (CPU)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.workdir / ("tiny" if args.tiny else "preview-random")
    make = [sys.executable, "-m", "tools.make_tiny", str(model_dir)] + ([] if args.tiny else ["--preview"])
    subprocess.run(make, check=True, cwd=ROOT)

    ar_port, dit_port, gateway_port = free_port(), free_port(), free_port()
    ar, dit = f"127.0.0.1:{ar_port}", f"127.0.0.1:{dit_port}"
    common = ["--model-dir", str(model_dir), "--device", args.device] + ([] if args.tiny else ["--random-weights"])
    commands = {
        "dit_service": ["dit_service", "--port", str(dit_port), *common],
        "ar_service": ["ar_service", "--port", str(ar_port), "--dit-address", dit, *common],
        "gateway": ["gateway", "--port", str(gateway_port), "--ar-address", ar, "--dit-address", dit],
    }
    watch = GpuMemoryWatch()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = {name: open(args.out / f"{name}.log", "w") for name in commands}
    processes = {
        name: subprocess.Popen([sys.executable, "-m", *cmd], cwd=ROOT, env=env, stdout=logs[name], stderr=subprocess.STDOUT)
        for name, cmd in commands.items()
    }
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        startup_s = wait_healthy(url, processes, timeout=600)
        body = {
            "prompt": "a photo of a red fox sitting in fresh snow, golden hour",
            "size": f"{args.size}x{args.size}",
            "num_inference_steps": args.steps,
            "text_guidance_scale": args.guidance,
            "seed": args.seed,
        }
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=1800)
        wall_s = time.perf_counter() - started
        response.raise_for_status()
        result = response.json()
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        peak = watch.stop()
    (args.out / "preview.png").write_bytes(base64.b64decode(result["data"][0]["b64_json"]))
    timings = result["timings"]
    report = {
        "request": body,
        "startup_s": round(startup_s, 1),
        "wall_s": round(wall_s, 2),
        "timings_ms": timings,
        "ar_ms_per_token": round(timings["ar_decode_ms"] / max(1, timings["ar_tokens"] - 1), 3),
        "peak_gpu_mib": {name: peak.get(process.pid) for name, process in processes.items()},
        "service_logs": {
            name: [line for line in (args.out / f"{name}.log").read_text().splitlines() if "ready" in line or "param" in line]
            for name in ("ar_service", "dit_service")
        },
    }
    (args.out / "preview_e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
