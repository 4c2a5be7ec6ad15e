"""What AR classifier-free guidance costs: the services with and without it, same sizes, same concurrency.

Usage (one H200, about five minutes)::

    python -m bench.ar_guidance --out bench/results/h200/ar_guidance.json

Starts the three services once (the Preview-shaped skeleton with random bf16 weights, as ``bench.harness``), then
for each point SIZE:STEPS (default ``512:20,1024:50``): one uncounted warm-up request, and for each
``ar_cfg_scale`` (``--scales``, default ``1,6``: off, and the released code's default) and each concurrency
(``--concurrency``, default ``1,4``) a closed loop of the harness's clients (``bench.harness.closed_loop``: client i
starts i * (c1 latency / c) after client 0) sending ``--requests`` requests (default ``1=2,4=4``: two at c1, four at
c4), each with that ``ar_cfg_scale``. With guidance every image decodes a second row in the same batched step, so
the AR's cost per token is a step of 2c rows instead of c.

Writes the JSON (the harness's per-run summaries under ``runs``, and ``comparison``: per size and concurrency,
guided against unguided AR decode time, ms per token, latency and throughput) and a markdown table beside it
(same name, ``.md``). Request seeds are ``--seed`` + a running number and are the same for every scale.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from bench.harness import GrpcClient, RestClient, closed_loop, machine_info, parse_ints, parse_size_limits, summarize
from bench.inprocess import parse_points
from bench.services import ServiceStack, make_model_dir

KEYS = ("ar_decode_ms", "ar_ms_per_token", "ar_prefill_ms", "denoise_ms", "total_ms")


def parse_scales(text: str) -> list[float]:
    scales = [float(part) for part in text.split(",") if part.strip()]
    if not scales or any(s < 1 for s in scales):
        raise argparse.ArgumentTypeError(f"expected ar_cfg_scale values >= 1 separated by commas; got {text!r}")
    return scales


def compare(runs: list[dict]) -> list[dict]:
    """Per (size, steps, concurrency): each guided scale against the first scale (the unguided one)."""
    rows = []
    keyed = {(r["size"], r["steps"], r["concurrency"], r["ar_cfg_scale"]): r for r in runs if r.get("stages_ms")}
    points = sorted({(size, steps, c) for size, steps, c, _ in keyed})
    scales = sorted({scale for *_, scale in keyed})
    for size, steps, c in points:
        base = keyed.get((size, steps, c, scales[0]))
        for scale in scales[1:]:
            run = keyed.get((size, steps, c, scale))
            if base is None or run is None:
                continue
            row = {"size": size, "steps": steps, "concurrency": c, "base_scale": scales[0], "scale": scale}
            for key in KEYS:
                row[f"base_{key}"], row[key] = base["stages_ms"].get(key), run["stages_ms"].get(key)
            row["base_latency_s"], row["latency_s"] = base["latency_s"]["mean"], run["latency_s"]["mean"]
            row["base_images_per_s"] = base.get("throughput_images_per_s")
            row["images_per_s"] = run.get("throughput_images_per_s")
            row["ar_decode_ratio"] = row["ar_decode_ms"] / row["base_ar_decode_ms"]
            row["latency_ratio"] = row["latency_s"] / row["base_latency_s"]
            rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# AR guidance: cost in the services",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}; machine: {report['machine'].get('gpu') or str(report['machine'].get('cpus')) + ' CPUs'}",
        f"- model: {report['model']}; services started in {report['startup_s']:.1f} s",
        "",
        "| size/steps | c | ar_cfg_scale | AR decode s (off -> on) | AR ms/token | latency s | x AR decode | x latency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["comparison"]:
        lines.append(
            f"| {row['size']}/{row['steps']} | {row['concurrency']} | {row['base_scale']:g} -> {row['scale']:g} | "
            f"{row['base_ar_decode_ms'] / 1e3:.2f} -> {row['ar_decode_ms'] / 1e3:.2f} | "
            f"{row['base_ar_ms_per_token']:.2f} -> {row['ar_ms_per_token']:.2f} | "
            f"{row['base_latency_s']:.2f} -> {row['latency_s']:.2f} | {row['ar_decode_ratio']:.3f} | "
            f"{row['latency_ratio']:.3f} |"
        )
    failed = [r for r in report["runs"] if r.get("failed")]
    if failed:
        lines += ["", f"{len(failed)} runs had failed requests: " + "; ".join(str(r.get("errors")) for r in failed)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.ar_guidance", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write (the markdown goes beside it)")
    parser.add_argument("--points", type=parse_points, default=parse_points("512:20,1024:50"))
    parser.add_argument("--concurrency", type=parse_ints, default=parse_ints("1,4"))
    parser.add_argument("--scales", type=parse_scales, default=parse_scales("1,6"),
                        help="ar_cfg_scale values, the unguided one (1) first (default 1,6)")
    parser.add_argument("--requests", type=parse_size_limits, default=parse_size_limits("1=2,4=4"),
                        help="C=N pairs: requests per run at concurrency C (default 1=2,4=4; others: max(4, 2C))")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted requests per size before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--via", choices=("rest", "grpc"), default="rest")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny model with its own weights (e.g. --device cpu)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-bench"))
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--extra-ar", default="", help="extra ar_service flags, space-separated (--extra-ar=...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = argv if argv is not None else sys.argv[1:]
    report: dict = {
        "command": "python -m bench.ar_guidance " + shlex.join(command),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(args.device),
        "model": "tiny" if args.tiny else "preview-random",
        "via": args.via,
        "runs": [],
    }
    model_dir = make_model_dir(args.workdir, args.tiny)
    stack = ServiceStack(model_dir, args.out.parent / (args.out.stem + "-logs"), device=args.device,
                         random_weights=not args.tiny, request_timeout_s=args.timeout_s, extra_ar=args.extra_ar.split())
    clients = []
    try:
        report["startup_s"] = stack.start()
        print(f"[ar_guidance] services up in {report['startup_s']:.1f} s", flush=True)
        for scale in args.scales:
            knobs = {"ar_cfg_scale": scale}
            clients.append(GrpcClient(stack.ar_address, args.timeout_s, knobs) if args.via == "grpc"
                           else RestClient(stack.url, args.timeout_s, knobs))
        for p, (size, steps) in enumerate(args.points):
            c1_latency = 0.0
            for k in range(args.warmup):
                warm = clients[0](size, steps, args.seed + 1_000_000 + k, None)
                if warm.error:
                    raise SystemExit(f"warm-up request at {size}x{size}/{steps} failed: {warm.error}")
                c1_latency = warm.latency_s
            for scale, send in zip(args.scales, clients, strict=True):
                latency = c1_latency
                for j, c in enumerate(args.concurrency):
                    seed = args.seed + 10_000 * p + 100 * j  # the same requests for every scale
                    requests = args.requests.get(c, max(4, 2 * c))
                    print(f"[ar_guidance] {size}x{size}/{steps} c{c} ar_cfg_scale {scale:g}: {requests} requests",
                          flush=True)
                    outcomes = closed_loop(send, size, steps, c, requests, latency / c, seed, None)
                    run = {"size": size, "steps": steps, "concurrency": c, "ar_cfg_scale": scale, "requests": requests,
                           **summarize(outcomes, c), "knobs": next((o.knobs for o in outcomes if o.knobs), None)}
                    report["runs"].append(run)
                    if c == 1 and run.get("latency_s"):
                        latency = run["latency_s"]["mean"]
                    stages = run.get("stages_ms") or {}
                    print(f"[ar_guidance]   done {run['completed']}/{requests}: AR decode "
                          f"{stages.get('ar_decode_ms', float('nan')) / 1e3:.2f} s, "
                          f"{stages.get('ar_ms_per_token', float('nan')):.2f} ms/token", flush=True)
    finally:
        for client in clients:
            client.close()
        stack.stop()
        report["comparison"] = compare(report["runs"])
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        if "startup_s" in report:
            args.out.with_suffix(".md").write_text(markdown(report))
    print(f"[ar_guidance] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
