"""Throughput at concurrency N against concurrency 1, on the Preview shapes, through the gateway.

Usage (CUDA machine): ``python -m bench.concurrency_check --out DIR [--size 512 --steps 20 --concurrency 4]``.
Starts the three services on a Preview-shaped skeleton with random bf16 weights, sends one request alone,
then ``--concurrency`` requests at once, and writes ``DIR/concurrency.json``: each latency, the throughput
ratio (images/s at N over images/s at 1), and the engines' GetStatus (largest batch). ``--tiny --device cpu``
runs the same on the tiny model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import grpc
import httpx

from bench.preview_e2e import GpuMemoryWatch, free_port, wait_healthy
from protos import ar_pb2_grpc, common_pb2, dit_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def status(address: str, stub_class) -> dict:
    with grpc.insecure_channel(address) as channel:
        reply = stub_class(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=10)
    return {field.name: getattr(reply, field.name) for field in reply.DESCRIPTOR.fields}


def main(argv: list[str] | None = None) -> int:
    import os
    import subprocess

    parser = argparse.ArgumentParser(prog="python -m bench.concurrency_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-concurrency"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--extra-ar", default="", help="extra ar_service flags, space-separated")
    parser.add_argument("--extra-dit", default="", help="extra dit_service flags, space-separated")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.workdir / ("tiny" if args.tiny else "preview-random")
    subprocess.run([sys.executable, "-m", "tools.make_tiny", str(model_dir)] + ([] if args.tiny else ["--preview"]),
                   check=True, cwd=ROOT)
    ar_port, dit_port, gateway_port = free_port(), free_port(), free_port()
    ar, dit = f"127.0.0.1:{ar_port}", f"127.0.0.1:{dit_port}"
    common = ["--model-dir", str(model_dir), "--device", args.device] + ([] if args.tiny else ["--random-weights"])
    commands = {
        "dit_service": ["dit_service", "--port", str(dit_port), *common, *args.extra_dit.split()],
        "ar_service": ["ar_service", "--port", str(ar_port), "--dit-address", dit, *common, *args.extra_ar.split()],
        "gateway": ["gateway", "--port", str(gateway_port), "--ar-address", ar, "--dit-address", dit,
                    "--request-timeout-s", "3000"],
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = {
        name: subprocess.Popen([sys.executable, "-m", *cmd], cwd=ROOT, env=env,
                               stdout=open(args.out / f"{name}.log", "w"), stderr=subprocess.STDOUT)
        for name, cmd in commands.items()
    }
    watch = GpuMemoryWatch()
    url = f"http://127.0.0.1:{gateway_port}"

    def one(seed: int, size: int | None = None, steps: int | None = None) -> float:
        side = size or args.size
        body = {"prompt": f"a red fox number {seed}", "size": f"{side}x{side}",
                "num_inference_steps": steps or args.steps, "seed": seed}
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=3000)
        response.raise_for_status()
        return time.perf_counter() - started

    try:
        wait_healthy(url, processes, timeout=600)
        one(10_000, size=128, steps=2)  # warm-up: CUDA context, cuBLAS handles
        alone = one(0)
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            together = list(pool.map(one, range(1, args.concurrency + 1)))
        wall = time.perf_counter() - started
        engines = {"ar": status(ar, ar_pb2_grpc.ImageGeneratorStub), "dit": status(dit, dit_pb2_grpc.RendererStub)}
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        peak = watch.stop()
    report = {
        "size": args.size, "steps": args.steps, "concurrency": args.concurrency,
        "c1_latency_s": round(alone, 2),
        "cN_latencies_s": [round(x, 2) for x in together],
        "cN_wall_s": round(wall, 2),
        "throughput_ratio": round((args.concurrency / wall) / (1 / alone), 3),
        "engines": engines,
        "peak_gpu_mib": {name: peak.get(p.pid) for name, p in processes.items()},
    }
    (args.out / "concurrency.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
