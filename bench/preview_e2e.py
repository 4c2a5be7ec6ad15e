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
import sys
import time
from pathlib import Path

import httpx

from bench.report import emit
from bench.services import GpuMemoryWatch, ServiceStack, make_model_dir


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
    model_dir = make_model_dir(args.workdir, args.tiny)
    stack = ServiceStack(model_dir, args.out, device=args.device, random_weights=not args.tiny, request_timeout_s=1800)
    watch = GpuMemoryWatch()
    url = stack.url
    try:
        startup_s = stack.start(timeout_s=600)
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
        stack.stop()
        peak = watch.stop()
    (args.out / "preview.png").write_bytes(base64.b64decode(result["data"][0]["b64_json"]))
    timings = result["timings"]
    report = {
        "request": body,
        "startup_s": round(startup_s, 1),
        "wall_s": round(wall_s, 2),
        "timings_ms": timings,
        "ar_ms_per_token": round(timings["ar_decode_ms"] / max(1, timings["ar_tokens"] - 1), 3),
        "peak_gpu_mib": {name: peak.get(pid) for name, pid in stack.pids.items()},
        "service_logs": {name: stack.log_lines(name, "ready", "param") for name in ("ar_service", "dit_service")},
    }
    emit(report, args.out / "preview_e2e.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
