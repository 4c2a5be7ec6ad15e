"""Throughput at saturation: closed loops of many clients against the three services on one device.

Usage (one H200; about seven minutes for the three default points)::

    python -m bench.saturation --out bench/results/h200/saturation
    python -m bench.saturation --out DIR --service-arg --quantization=fp8      # the same points, FP8 services

and on a CPU, with the tiny model: ``python -m bench.saturation --out DIR --tiny --device cpu --points 128:2:2``.

Each point SIZE:STEPS:CLIENTS (``--points``, default ``512:20:16,512:20:32,1024:50:8``) runs CLIENTS clients, each
sending its next request through the gateway as soon as its previous one has returned. The clients start together
(``--ramp-s`` spreads their starts). A warm-up runs until every client has had an answer and at least
``--warmup-s`` have passed (first-use compilation and CUDA-graph captures of new batch shapes happen there); then
a measured window of ``--window-s`` or ``--window-latencies`` times the warm-up's mean latency, whichever is longer
(at most ``--max-window-s``, but never under ``MIN_WINDOW_LATENCIES`` mean latencies: clients that started together
stay in step, and a shorter window can close before any of them ends a request). When the window closes, the
requests still in flight are abandoned (the gateway cancels them downstream) and the next point waits until both
engines are idle. Per point: throughput (images whose request ended inside the window, over the window), client
latency mean/p50/p95/p99 of those requests, the services' stage timings averaged over them, and, from the engines'
Prometheus histograms over the window, the mean decode streams per AR step and images per DiT step with each step's
mean wall time: which stage held the GPU.

The services run with settings for many streams (``SATURATION_AR_ARGS``, ``SATURATION_DIT_ARGS``: 32 decode
streams, or as many as fit the AR's 70% share of the GPU, DiT batches of 8, queues deep enough for 32 clients);
``--service-arg`` (both model services), ``--ar-arg`` and ``--dit-arg`` add flags after them (a later flag wins).
The precision label of the run is ``fp8`` when a service flag asks for it, else the model dtype, unless ``--label``
says otherwise.

Writes ``OUT/saturation.json`` (after every point, so a run cut short keeps what it measured) and
``OUT/SATURATION.md`` (``bench.saturation_report``: the points and the project's throughput targets, pass/fail).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import saturation_report
from bench.harness import (
    GENERATIONS_PATH,
    PROMPT,
    Outcome,
    _engine_deltas,
    _engine_status,
    add_run_options,
    latency_summary,
    machine_info,
    outcome_of,
    parse_env,
    request_body,
    stage_means,
)
from bench.services import GpuMemoryWatch, ServiceStack, free_port, make_model_dir

RESULT_NAME = "saturation.json"
MARKDOWN_NAME = "SATURATION.md"
LOGS_DIR = "raw"
DEFAULT_POINTS = "512:20:16,512:20:32,1024:50:8"

#: ar_service for many streams: 32 images decode in one step (64 decoder rows with AR guidance: past the triton
#: kernels' 16 rows, so the torch kernels run; ``--ar-arg=--max-batch-size=8`` keeps triton), a queue for 32 more,
#: the K/V slots sized for 1024x1024 at most (the largest size measured), not the model's 2048, and 70% of the GPU,
#: which the two services share: on an 80 GB card ~56 GiB for the AR (~20 GB of weights, the rest for its decode
#: slots and graphs) and ~24 GiB left for the DiT (7-12 GiB) and both CUDA contexts. Where 32 images do not fit that
#: share, the AR decodes as many as do and its log says so (docs/ar_batching.md, "Decode memory"); the run records
#: the batch it got (``engines``' ``max_batch_size``).
SATURATION_AR_ARGS = ["--max-batch-size", "32", "--max-queued-requests", "64", "--max-pixels", str(1024 * 1024),
                      "--gpu-memory-utilization", "0.7"]
#: dit_service: batches of 8 images, room for every AR stream's render to be admitted at its header, and a CUDA
#: graph for each batch size of both sizes (1..8 images at 512 and at 1024).
SATURATION_DIT_ARGS = ["--max-batch-size", "8", "--max-queued-renders", "64", "--cuda-graphs", "24"]
PASS_THROUGH = ("--service-arg", "--ar-arg", "--dit-arg")
ERROR_PAUSE_S = 0.5
#: The shortest window, in warm-up mean latencies, whatever --max-window-s says. Measured: 8 clients at 1024x1024/50
#: in FP8 ran a 55 s window against a ~60 s latency, and no request ended inside it.
MIN_WINDOW_LATENCIES = 1.25


@dataclass(frozen=True)
class Point:
    size: int
    steps: int
    clients: int

    @property
    def label(self) -> str:
        return f"{self.size}:{self.steps}:{self.clients}"


def parse_points(text: str) -> list[Point]:
    points = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            size, steps, clients = (int(v) for v in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected SIZE:STEPS:CLIENTS, comma-separated; got {part!r}") from None
        if min(size, steps, clients) < 1:
            raise argparse.ArgumentTypeError(f"SIZE, STEPS and CLIENTS must be positive; got {part!r}")
        points.append(Point(size, steps, clients))
    if not points:
        raise argparse.ArgumentTypeError("no points given")
    return points


def join_pass_through(argv: list[str]) -> list[str]:
    """``--service-arg --quantization=fp8`` -> ``--service-arg=--quantization=fp8``: argparse refuses a value that
    starts with a dash, and every value of these options does."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PASS_THROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def precision_label(service_args: list[str], dtype: str) -> str:
    """fp8 when a service flag asks for it (``--quantization fp8`` or ``--quantization=fp8``), else the dtype's name."""
    joined = " ".join(service_args).replace("=", " ").split()
    for flag, value in zip(joined, joined[1:], strict=False):
        if flag == "--quantization" and value.lower() != "none":
            return value.lower()
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)


# -- metrics -----------------------------------------------------------------------------------------------------------

HISTOGRAMS = {
    "ar": ("ardit_ar_batch_size", "ardit_ar_decode_step_seconds"),
    "dit": ("ardit_dit_batch_size", "ardit_dit_step_seconds", "ardit_dit_batch_window_seconds"),
}


def scrape(url: str) -> dict[str, float]:
    """The ``_sum`` and ``_count`` samples of a Prometheus text page; empty when the page does not answer."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.endswith(("_sum", "_count"))}


def batch_figures(before: dict[str, dict], after: dict[str, dict], window_s: float) -> dict:
    """What the engines' histograms gained over the window: steps, mean streams (AR) or images (DiT) per step, mean
    step wall time, and the share of the window each engine spent inside its steps (the two overlap on one GPU: each
    step's wall time includes waiting for the other process's kernels)."""

    def gained(engine: str, name: str) -> tuple[float, float]:
        b, a = before.get(engine, {}), after.get(engine, {})
        return (a.get(f"{name}_sum", 0.0) - b.get(f"{name}_sum", 0.0),
                a.get(f"{name}_count", 0.0) - b.get(f"{name}_count", 0.0))

    figures: dict = {}
    for engine, unit in (("ar", "streams"), ("dit", "images")):
        size_name, step_name = HISTOGRAMS[engine][:2]
        rows, steps = gained(engine, size_name)
        seconds, timed = gained(engine, step_name)
        figures[engine] = {
            "steps": int(steps),
            f"{unit}_per_step": rows / steps if steps else None,
            "step_ms": seconds / timed * 1e3 if timed else None,
            "busy_fraction": seconds / window_s if window_s > 0 else None,
        }
    waited, windows = gained("dit", HISTOGRAMS["dit"][2])
    figures["dit"].update(batch_windows=int(windows), batch_window_ms=waited / windows * 1e3 if windows else None)
    return figures


# -- one point -----------------------------------------------------------------------------------------------------------


async def _send(http: httpx.AsyncClient, point: Point, seed: int, guidance: float | None, knobs: dict) -> Outcome:
    start = time.perf_counter()
    try:
        response = await http.post(GENERATIONS_PATH, json=request_body(point.size, point.steps, seed, guidance, knobs))
    except httpx.HTTPError as exc:
        return Outcome(seed, start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    return outcome_of(response, seed, start, time.perf_counter())


@dataclass
class LoopTimes:
    started: float
    measured_from: float
    measured_to: float


async def closed_loop(send, point: Point, first_seed: int, *, ramp_s: float, warmup_s: float, max_warmup_s: float,
                      window_s: float, window_latencies: float, max_window_s: float,
                      on_window=None) -> tuple[list[Outcome], LoopTimes]:
    """Runs ``point.clients`` clients, each sending ``send(seed)`` again as soon as it returns, through a warm-up and a
    measured window (see the module docstring); returns every finished outcome and the window's bounds. Requests in
    flight at the window's end are cancelled and not returned. ``on_window(start)`` is awaited when the window
    opens (to read the engines' counters)."""
    outcomes: list[Outcome] = []
    answered = [asyncio.Event() for _ in range(point.clients)]
    next_seed = first_seed

    async def client(i: int) -> None:
        nonlocal next_seed
        await asyncio.sleep(i * ramp_s / point.clients)
        while True:
            seed, next_seed = next_seed, next_seed + 1
            outcome = await send(seed)
            outcomes.append(outcome)
            answered[i].set()
            if outcome.error is not None:
                await asyncio.sleep(ERROR_PAUSE_S)  # a refused or failed request: no tight retry loop

    started = time.perf_counter()
    tasks = [asyncio.create_task(client(i)) for i in range(point.clients)]
    try:
        everyone = asyncio.gather(*(event.wait() for event in answered))
        try:
            await asyncio.wait_for(asyncio.shield(everyone), timeout=max_warmup_s)
        except TimeoutError:
            pass  # some client never got an answer in time: measure anyway, the report shows the failures
        everyone.cancel()
        await asyncio.sleep(max(0.0, started + warmup_s - time.perf_counter()))
        warm = [o.latency_s for o in outcomes if o.error is None]
        latency = sum(warm) / len(warm) if warm else 0.0
        window = max(min(max(window_s, window_latencies * latency), max_window_s), MIN_WINDOW_LATENCIES * latency)
        measured_from = time.perf_counter()
        if on_window is not None:
            await on_window(measured_from)
        await asyncio.sleep(window)
        measured_to = time.perf_counter()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes, LoopTimes(started, measured_from, measured_to)


def summarize_window(outcomes: list[Outcome], times: LoopTimes) -> dict:
    """Throughput, latency and stage means of the requests that ended inside the window."""
    window = times.measured_to - times.measured_from
    inside = [o for o in outcomes if times.measured_from <= o.end <= times.measured_to]
    done = [o for o in inside if o.error is None]
    summary: dict = {
        "warmup_s": times.measured_from - times.started, "window_s": window,
        "completed": len(done), "failed": len(inside) - len(done),
        "failed_in_warmup": sum(1 for o in outcomes if o.error is not None and o.end < times.measured_from),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "throughput_images_per_s": sum(o.images for o in done) / window if window > 0 else None,
    }
    if done:
        summary["latency_s"] = latency_summary([o.latency_s for o in done])
        summary["stages_ms"] = stage_means(done)
    return summary


def wait_idle(stack: ServiceStack, timeout_s: float = 120.0) -> bool:
    """Waits until both engines have nothing queued or running (the abandoned requests have left)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _engine_status(stack)
        engines = [status.get("ar"), status.get("dit")]
        if all(isinstance(e, dict) and e.get("queued") == 0 and e.get("running") == 0 for e in engines):
            return True
        time.sleep(0.5)
    return False


def run_point(args: argparse.Namespace, stack: ServiceStack, metrics: dict[str, str], watch: GpuMemoryWatch,
              point: Point, first_seed: int) -> dict:
    knobs = dict(args.knob)
    counters: dict = {}

    async def main() -> tuple[list[Outcome], LoopTimes]:
        limits = httpx.Limits(max_connections=point.clients + 4, max_keepalive_connections=point.clients + 4)
        async with httpx.AsyncClient(base_url=stack.url, timeout=args.timeout_s, limits=limits) as http:

            async def on_window(_start: float) -> None:
                await asyncio.to_thread(watch.lap)  # nvidia-smi: not on the clients' event loop
                counters["before"] = await asyncio.to_thread(lambda: {k: scrape(u) for k, u in metrics.items()})
                counters["status_before"] = await asyncio.to_thread(_engine_status, stack)

            return await closed_loop(
                lambda seed: _send(http, point, seed, args.guidance, knobs), point, first_seed,
                ramp_s=args.ramp_s, warmup_s=args.warmup_s, max_warmup_s=args.max_warmup_s, window_s=args.window_s,
                window_latencies=args.window_latencies, max_window_s=args.max_window_s, on_window=on_window,
            )

    print(f"[saturation] {point.size}x{point.size}/{point.steps} steps, {point.clients} clients", flush=True)
    outcomes, times = asyncio.run(main())
    after = {k: scrape(u) for k, u in metrics.items()}
    engines = _engine_status(stack)
    peaks = watch.lap()
    result = {"size": point.size, "steps": point.steps, "clients": point.clients, "first_seed": first_seed,
              "requests_sent": len(outcomes), **summarize_window(outcomes, times)}
    result["batching"] = batch_figures(counters.get("before", {}), after, result["window_s"])
    result["engines"] = engines
    result["engine_counts"] = _engine_deltas(counters.get("status_before", {}), engines)
    result["peak_gpu_mib"] = {name: peaks.get(pid) for name, pid in stack.pids.items()} if watch.available else None
    result["knobs"] = next((o.knobs for o in outcomes if o.knobs), None)
    result["samples"] = [{"seed": o.seed, "start_s": o.start - times.started, "latency_s": o.latency_s,
                          "in_window": times.measured_from <= o.end <= times.measured_to, "timings": o.timings,
                          "error": o.error} for o in outcomes]
    result["idle_after"] = wait_idle(stack)
    lat = result.get("latency_s") or {}
    print(f"[saturation]   {result['completed']} images in {result['window_s']:.1f} s: "
          f"{result['throughput_images_per_s'] or 0:.3f} img/s, p50 {lat.get('p50', float('nan')):.2f} s, "
          f"p95 {lat.get('p95', float('nan')):.2f} s, failed {result['failed']}", flush=True)
    return result


# -- the run -----------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.saturation", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help=f"directory for {RESULT_NAME}, {MARKDOWN_NAME} and logs")
    parser.add_argument("--points", type=parse_points, default=parse_points(DEFAULT_POINTS),
                        help=f"SIZE:STEPS:CLIENTS, comma-separated (default {DEFAULT_POINTS})")
    parser.add_argument("--warmup-s", type=float, default=15.0,
                        help="least warm-up per point, seconds; it also lasts until every client has had an answer")
    parser.add_argument("--max-warmup-s", type=float, default=240.0, help="longest wait for every client's first answer")
    parser.add_argument("--window-s", type=float, default=60.0, help="least measured window per point, seconds")
    parser.add_argument("--window-latencies", type=float, default=2.0,
                        help="the window lasts at least this many times the warm-up's mean latency")
    parser.add_argument("--max-window-s", type=float, default=120.0,
                        help="longest measured window per point, unless MIN_WINDOW_LATENCIES warm-up mean latencies "
                        "are longer")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="spread the clients' first requests over this long")
    add_run_options(parser)
    parser.add_argument("--service-arg", action="append", default=[],
                        help="a flag for both model services, after the saturation settings (repeatable; "
                             "e.g. --service-arg --quantization=fp8)")
    parser.add_argument("--ar-arg", action="append", default=[], help="a flag for ar_service only (repeatable)")
    parser.add_argument("--dit-arg", action="append", default=[], help="a flag for dit_service only (repeatable)")
    parser.add_argument("--env-ar", type=parse_env, default={},
                        help="KEY=VALUE pairs, comma-separated, set in ar_service's environment only")
    parser.add_argument("--env-dit", type=parse_env, default={},
                        help="the same for dit_service (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60 under CUDA MPS)")
    parser.add_argument("--label", default=None, help="precision label of the run (default: fp8 or the dtype)")
    return parser


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(join_pass_through(command))
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    ar_metrics, dit_metrics = free_port(), free_port()
    extra_ar = [*SATURATION_AR_ARGS, *args.service_arg, *args.ar_arg, "--metrics-port", str(ar_metrics)]
    extra_dit = [*SATURATION_DIT_ARGS, *args.service_arg, *args.dit_arg, "--metrics-port", str(dit_metrics)]
    result: dict = {
        "command": "python -m bench.saturation " + shlex.join(command),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(args.device),
        "model": "tiny" if args.tiny else "preview-random",
        "dtype": dtype,
        "precision": args.label or precision_label([*args.service_arg, *args.ar_arg, *args.dit_arg], dtype),
        "prompt": PROMPT,
        "service_args": {"ar_service": extra_ar[:-2], "dit_service": extra_dit[:-2]},
        "service_env": {"ar_service": args.env_ar, "dit_service": args.env_dit},
        "points": [],
    }
    path = args.out / RESULT_NAME
    model_dir = make_model_dir(args.workdir, args.tiny)
    stack = ServiceStack(model_dir, args.out / LOGS_DIR, device=args.device, random_weights=not args.tiny,
                         request_timeout_s=args.timeout_s, extra_ar=extra_ar, extra_dit=extra_dit,
                         env_ar=args.env_ar, env_dit=args.env_dit)
    metrics = {"ar": f"http://127.0.0.1:{ar_metrics}/metrics", "dit": f"http://127.0.0.1:{dit_metrics}/metrics"}
    watch = GpuMemoryWatch()
    try:
        result["startup_s"] = stack.start()
        print(f"[saturation] services up in {result['startup_s']:.1f} s", flush=True)
        result["service_logs"] = {name: stack.log_lines(name, "ready", "fast decode", "decode kernels", "decode memory")
                                  for name in ("ar_service", "dit_service")}
        seed = args.seed
        for point in args.points:
            measured = run_point(args, stack, metrics, watch, point, seed)
            seed += measured["requests_sent"]
            result["points"].append(measured)
            path.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        stack.stop()
        peaks = watch.stop()
        result["peak_gpu_mib"] = {name: peaks.get(pid) for name, pid in stack.pids.items()} if watch.available else None
        path.write_text(json.dumps(result, indent=2) + "\n")
    markdown = args.out / MARKDOWN_NAME
    markdown.write_text(saturation_report.render([result]))
    print(f"[saturation] wrote {path} and {markdown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
