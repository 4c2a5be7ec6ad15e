"""One image at a time end to end through the three services, at the released shapes, with per-stage numbers.

Usage (on a CUDA machine): ``python -m bench.preview_e2e --out DIR [--member dev] [--points 1024:50,512:20]``.
Writes a Preview- or Dev-shaped checkpoint directory holding configs and tokenizer only, starts
dit_service and ar_service with ``--random-weights`` (bf16, built straight on the GPU) and the
gateway, sends one request per point (``SIZE:STEPS``, one at a time, over one kept connection), and writes ``DIR/preview_e2e.json`` with
each response's stage timings, the AR's milliseconds per decode forward against the least time its weights take to
read (the weight bytes one forward reads, ``bench.workload.decode_weight_bytes``, over the copy bandwidth measured
on the card before the services start, ``bench.bounds.copy_bandwidth``), each service's load lines and peak GPU
memory (from nvidia-smi, per process).
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


def input_picture(size: int) -> bytes:
    """A SIZExSIZE PNG to edit: a smooth colour ramp (its content does not change the work an edit does)."""
    import io

    from PIL import Image

    ramp = Image.linear_gradient("L").resize((size, size))
    picture = Image.merge("RGB", (ramp, ramp.transpose(Image.Transpose.ROTATE_90), Image.new("L", (size, size), 96)))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def _send(client: httpx.Client, edit: bool, body: dict) -> httpx.Response:
    """One request: a generation (JSON), or an edit of an input picture of the asked size (multipart, size auto)."""
    if not edit:
        return client.post("/v1/images/generations", json=body)
    size = int(body["size"].split("x")[0])
    form = {key: str(value) for key, value in body.items() if key != "size"}
    files = {"image": ("input.png", input_picture(size), "image/png")}
    return client.post("/v1/images/edits", data={**form, "size": "auto"}, files=files)


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1024:50,512:20"`` -> [(1024, 50), (512, 20)]: square sizes and their denoising steps."""
    points = []
    for item in text.split(","):
        size, _, steps = item.partition(":")
        points.append((int(size), int(steps)))
    return points


def weight_read_bound(model_dir: Path, device: str) -> dict:
    """The least milliseconds one bf16 AR decode forward can take on this card: its weight bytes over the copy
    bandwidth measured here."""
    from ar_service.model.configuration import ar_config_from_dict
    from bench.bounds import Settings, copy_bandwidth
    from bench.workload import decode_weight_bytes
    from servicekit.checkpoint import open_checkpoint

    config = ar_config_from_dict(open_checkpoint(model_dir, require_weights=False).config)
    weight_bytes = decode_weight_bytes(config)
    bandwidth = copy_bandwidth(device, settings=Settings(min_warm_s=1.0))["gb_per_s"]
    return {"weight_bytes": weight_bytes, "copy_gb_per_s": round(bandwidth, 1),
            "bound_ms": round(weight_bytes / (bandwidth * 1e9) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preview_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--member", choices=("preview", "dev"), default="preview", help="which released shapes")
    parser.add_argument("--points", default="1024:50", help="SIZE:STEPS,... one request each, in this order")
    parser.add_argument("--guidance", type=float, default=9.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-preview"), help="where the model directory goes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="dry run with the member's tiny model (CPU)")
    parser.add_argument("--edit", action="store_true",
                        help="edit a SIZExSIZE input picture through /v1/images/edits instead (a model that edits: Dev)")
    parser.add_argument("--warmup", action="store_true",
                        help="send every point once first, unrecorded (a size's first render pays its lazy set-up)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = make_model_dir(args.workdir, args.tiny, args.member)
    bound = weight_read_bound(model_dir, args.device)
    stack = ServiceStack(model_dir, args.out, device=args.device, random_weights=not args.tiny, request_timeout_s=1800)
    watch = GpuMemoryWatch()
    # One client, one kept connection, as the openai client holds: a client made per request would add its own set-up
    # (httpx builds a TLS context even for http://, 15-40 ms) to every wall time.
    client = httpx.Client(base_url=stack.url, timeout=1800)
    results = []
    try:
        startup_s = stack.start(timeout_s=600)
        points = parse_points(args.points)
        for size, steps in points if args.warmup else ():
            _send(client, args.edit, {"prompt": "warm-up", "size": f"{size}x{size}", "num_inference_steps": steps,
                                   "seed": args.seed}).raise_for_status()
        for size, steps in points:
            body = {
                "prompt": ("make the fox white" if args.edit
                           else "a photo of a red fox sitting in fresh snow, golden hour"),
                "size": f"{size}x{size}",
                "num_inference_steps": steps,
                "text_guidance_scale": args.guidance,
                "seed": args.seed,
            }
            started = time.perf_counter()
            response = _send(client, args.edit, body)
            wall_s = time.perf_counter() - started
            response.raise_for_status()
            result = response.json()
            (args.out / f"{args.member}-{size}-{steps}.png").write_bytes(base64.b64decode(result["data"][0]["b64_json"]))
            timings = result["timings"]
            per_forward = timings["ar_decode_ms"] / max(1, timings.get("ar_forwards") or timings["ar_tokens"] - 1)
            results.append({
                "request": body,
                "wall_s": round(wall_s, 2),
                "timings_ms": timings,
                "ar_ms_per_forward": round(per_forward, 3),
                "ar_forward_over_bound": round(per_forward / bound["bound_ms"], 2),
            })
            print(f"{args.member} {size}x{size}/{steps}: {wall_s:.2f} s, AR {per_forward:.2f} ms a forward "
                  f"({per_forward / bound['bound_ms']:.2f}x the {bound['bound_ms']:.2f} ms weight-read bound)", flush=True)
    finally:
        client.close()
        stack.stop()
        peak = watch.stop()
    report = {
        "member": args.member,
        "startup_s": round(startup_s, 1),
        "warmup": args.warmup,
        "edit": args.edit,
        "weight_read_bound": bound,
        "points": results,
        "peak_gpu_mib": {name: peak.get(pid) for name, pid in stack.pids.items()},
        "service_logs": {name: stack.log_lines(name, "ready", "param") for name in ("ar_service", "dit_service")},
    }
    emit(report, args.out / "preview_e2e.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
