"""The benchmark harness: a sweep of sizes x concurrency through the running services, an in-process baseline
and the machine's physical bounds, in one run, into one raw JSON file and a dashboard.

Usage (CUDA machine)::

    python -m bench.harness --out bench/results/<machine>

and on a CPU, with the tiny model: ``python -m bench.harness --out DIR --tiny --device cpu --points 256:2``.

What one run does, in order:

1. Writes the model directory (the Preview-shaped skeleton, whose services build random bf16 weights on the
   device, or the tiny model with ``--tiny``) and starts dit_service, ar_service and the gateway once.
2. For each point SIZE:STEPS (``--points``, default ``512:20,1024:50``): ``--warmup`` requests that are not
   counted, then for each concurrency c (``--concurrency``, default 1,2,4,8) a closed loop of c clients sending
   ``--requests`` requests in all (default max(4, 2c)). Each client sends its next request when its previous one
   has finished. Client i starts i * ramp after client 0, with ramp = (that size's c1 mean latency) / c (before
   c1 has been measured, the warm-up latency stands in for it): the arrivals are spread over one request's
   lifetime, so one request's AR decode overlaps another's DiT denoise as it does under real, unsynchronised
   traffic, rather than all c requests decoding in lock step and then all rendering at once. Requests go through
   the gateway's ``POST /v1/images/generations`` (``--via rest``) or straight to ar_service's
   ``ImageGenerator.GenerateImage`` (``--via grpc``, the gRPC front door).
   Per point: client latency mean/p50/p95/p99, throughput (completed images / (last end - first start)), the
   steady throughput (images completed while all c clients were active, i.e. between the c-th request's start
   and the last request's start, over that window: the ramp and the drain left out), the
   services' own stage timings (the ``timings`` each answer carries) averaged, each engine's ``GetStatus`` after
   the point, and the peak GPU memory of each service process during the point (nvidia-smi; absent on a CPU).
3. Stops the services (freeing the device) and runs the same pipeline in this process at concurrency 1
   (``bench.inprocess``): the transport overhead per size is (c1 mean latency - in-process mean) / c1 mean.
4. Sets the AR's ms per decode token and the DiT's TFLOP/s against the device's copy bandwidth and bf16 matmul
   rate (``bench.bounds``: several sizes each, warmed up until the rate is steady, beside the card's datasheet
   peaks), measured first, on the idle device, before the services start.
5. Writes ``OUT/raw.json`` and the dashboard (``bench.dashboard``: ``DASHBOARD.md`` and ``dashboard.png``); the
   services' logs go to ``OUT/raw/``.

Request seeds are ``--seed`` + a running request number, so a rerun sends the same requests.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ar_service.prompt import GridRule
from bench import bounds, inprocess, ratios, workload
from bench.inprocess import parse_points
from bench.services import GpuMemoryWatch, ServiceStack, make_model_dir

PROMPT = "a photo of a red fox sitting in fresh snow, golden hour"
STAGE_KEYS = ("ar_prefill_ms", "ar_decode_ms", "condition_transfer_ms", "dit_queue_ms", "denoise_ms", "vae_decode_ms",
              "encode_ms", "gateway_ms", "total_ms", "ar_tokens", "ar_forwards", "transformer_calls",
              "dit_steps_computed", "dit_steps_skipped")
RAW_NAME = "raw.json"
LOGS_DIR = "raw"  # the services' logs (bench/results/*/raw/ is not tracked)


def _pairs(text: str, form: str) -> list[tuple[str, str]]:
    """``A=B,C=D`` -> [(A, B), (C, D)] (split at the first =); ``form`` names the pairs in the error."""
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected {form} pairs separated by commas; got {text!r}")
    return [(key.strip(), value) for key, value in pairs]


def parse_size_limits(text: str) -> dict[int, int]:
    try:
        return {int(size): int(limit) for size, limit in _pairs(text, "SIZE=C")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIZE=C pairs separated by commas; got {text!r}") from None


def parse_env(text: str) -> dict[str, str]:
    return dict(_pairs(text, "KEY=VALUE"))


def parse_knob(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` with a JSON value (``ar_cfg_scale=1``, ``cfg_range=[0,0.5]``); a value that is not JSON is a
    string (``cfg_execution_mode=packed``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE; got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas; got {text!r}")
    return values


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# -- one request -------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    seed: int
    start: float  # perf_counter
    end: float
    images: int = 0
    timings: dict | None = None
    knobs: dict | None = None
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.end - self.start


GENERATIONS_PATH = "/v1/images/generations"


def request_body(size: int, steps: int, seed: int, guidance: float | None, knobs: dict) -> dict:
    """The JSON body of one benchmark request: PROMPT at size x size, ``steps`` steps, this seed, the extra knobs."""
    body = {"prompt": PROMPT, "size": f"{size}x{size}", "num_inference_steps": steps, "seed": seed, **knobs}
    if guidance is not None:
        body["text_guidance_scale"] = guidance
    return body


def outcome_of(response: httpx.Response, seed: int, start: float, end: float) -> Outcome:
    """One REST answer as an Outcome: its images, the services' timings and knobs, or the error it carries."""
    if response.status_code != 200:
        return Outcome(seed, start, end, error=f"HTTP {response.status_code}: {response.text[:300]}")
    result = response.json()
    return Outcome(seed, start, end, images=len(result["data"]), timings=result["timings"], knobs=result["knobs"])


class RestClient:
    """POST /v1/images/generations on the gateway; the answer's ``timings`` are the services' own. ``knobs``: more
    per-model knobs sent with every request."""

    def __init__(self, url: str, timeout_s: float, knobs: dict | None = None):
        self.http = httpx.Client(base_url=url, timeout=timeout_s)
        self.knobs = dict(knobs or {})

    def __call__(self, size: int, steps: int, seed: int, guidance: float | None) -> Outcome:
        start = time.perf_counter()
        try:
            response = self.http.post(GENERATIONS_PATH, json=request_body(size, steps, seed, guidance, self.knobs))
        except httpx.HTTPError as exc:
            return Outcome(seed, start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
        return outcome_of(response, seed, start, time.perf_counter())

    def close(self) -> None:
        self.http.close()


class GrpcClient:
    """ImageGenerator.GenerateImage on ar_service (the gRPC front door): no gateway, so no ``gateway_ms``."""

    def __init__(self, address: str, timeout_s: float, knobs: dict | None = None):
        import grpc

        from protos import ar_pb2, ar_pb2_grpc
        from protos.channels import channel_options

        self.grpc, self.ar_pb2, self.timeout_s = grpc, ar_pb2, timeout_s
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = ar_pb2_grpc.ImageGeneratorStub(self.channel)
        self.knobs = dict(knobs or {})

    def __call__(self, size: int, steps: int, seed: int, guidance: float | None) -> Outcome:
        from gateway.translate import timings_to_dict
        from protos.values import knobs_from_proto, knobs_to_proto

        knobs = {"num_inference_steps": steps, **self.knobs} | ({} if guidance is None else {"text_guidance_scale": guidance})
        request = self.ar_pb2.GenerateImageRequest(prompt=PROMPT, width=size, height=size, n=1, seed=seed,
                                                   knobs=knobs_to_proto(knobs))
        start = time.perf_counter()
        try:
            reply = self.stub.GenerateImage(request, timeout=self.timeout_s)
        except self.grpc.RpcError as exc:
            return Outcome(seed, start, time.perf_counter(), error=f"{exc.code().name}: {exc.details()}")
        end = time.perf_counter()
        return Outcome(seed, start, end, images=len(reply.images), timings=timings_to_dict(reply.timings),
                       knobs=knobs_from_proto(reply.knobs))

    def close(self) -> None:
        self.channel.close()


# -- one point: a closed loop of c clients ---------------------------------------------------------------------------


def closed_loop(send, size: int, steps: int, concurrency: int, requests: int, ramp_s: float, first_seed: int,
                guidance: float | None, sleep=time.sleep) -> list[Outcome]:
    """``concurrency`` client threads share ``requests`` requests; each sends its next one when its previous one has
    finished; client i starts ``i * ramp_s`` after client 0 (it calls ``sleep(i * ramp_s)`` first)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    issued = 0

    def client(i: int) -> None:
        nonlocal issued
        sleep(i * ramp_s)
        while True:
            with lock:
                if issued >= requests:
                    return
                seed = first_seed + issued
                issued += 1
            outcome = send(size, steps, seed, guidance)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(outcomes, key=lambda o: o.start)


def steady_throughput(outcomes: list[Outcome], concurrency: int) -> tuple[float | None, float]:
    """(images/s, window s) while all ``concurrency`` clients of a closed loop were active: from the start of the
    request that brought the last client in to the start of the last request (after which the clients drain).
    None when the point has no such window (no more requests than clients)."""
    starts = sorted(o.start for o in outcomes)
    if len(starts) <= concurrency:
        return None, 0.0
    first, last = starts[concurrency - 1], starts[-1]
    images = sum(o.images for o in outcomes if o.error is None and first < o.end <= last)
    window = last - first
    return (images / window if window > 0 and images else None), window


def summarize(outcomes: list[Outcome], concurrency: int = 1) -> dict:
    """Latency percentiles, throughput (overall and steady) and the mean of every stage timing over the completed
    requests."""
    done = [o for o in outcomes if o.error is None]
    summary: dict = {"completed": len(done), "failed": len(outcomes) - len(done),
                     "errors": sorted({o.error for o in outcomes if o.error})[:5]}
    if not done:
        return summary
    wall = max(o.end for o in outcomes) - min(o.start for o in outcomes)
    summary.update(
        latency_s=latency_summary([o.latency_s for o in done]),
        wall_s=wall,
        throughput_images_per_s=sum(o.images for o in done) / wall if wall > 0 else None,
    )
    summary["steady_throughput_images_per_s"], summary["steady_window_s"] = steady_throughput(outcomes, concurrency)
    summary["stages_ms"] = stage_means(done)
    return summary


def latency_summary(latencies: list[float]) -> dict:
    """Mean, p50, p95, p99, min and max of client latencies (seconds)."""
    return {"mean": statistics.fmean(latencies), "p50": percentile(latencies, 50), "p95": percentile(latencies, 95),
            "p99": percentile(latencies, 99), "min": min(latencies), "max": max(latencies)}


def stage_means(done: list[Outcome]) -> dict:
    """The mean of every stage timing the services reported over completed requests, the AR's ms per token and
    what the client waited beyond the services' own time."""
    stages = {}
    for key in STAGE_KEYS:
        values = [o.timings[key] for o in done if key in o.timings]
        if values:
            stages[key] = statistics.fmean(values)
    stages["ar_ms_per_token"] = statistics.fmean(o.timings["ar_decode_ms"] / max(1, o.timings["ar_tokens"]) for o in done)
    counted = [o for o in done if o.timings.get("ar_forwards")]
    if counted:  # tokens over forwards, summed over requests (ar_decoding speculative / row_parallel raise it above 1)
        stages["ar_tokens_per_forward"] = (sum(o.timings["ar_tokens"] for o in counted)
                                           / sum(o.timings["ar_forwards"] for o in counted))
    # What the client waited beyond the answering service's own wall clock (and the gateway's own time):
    # serialisation, the HTTP and gRPC hops, base64.
    stages["client_unaccounted_ms"] = statistics.fmean(
        o.latency_s * 1e3 - o.timings.get("total_ms", 0.0) - o.timings.get("gateway_ms", 0.0) for o in done
    )
    return stages


# -- the run -----------------------------------------------------------------------------------------------------------


def machine_info(device: str) -> dict:
    info = {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "device": device}
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    except ImportError:
        pass
    return info


def text_positions(model_dir: Path, size: int, rule: GridRule) -> tuple[int, int, int]:
    """(text condition positions of PROMPT at this size, grid width, grid height): what the AR hands the DiT, the
    grid by the checkpoint's grid rule."""
    from ar_service.conditions import prompt_ids_for, text_condition_mask
    from ar_service.model.configuration import ar_config_from_dict
    from ar_service.model.loading import load_tokenizer

    config = ar_config_from_dict(json.loads((model_dir / "config.json").read_text()))
    grid = rule.grid(size, size)
    ids = prompt_ids_for(load_tokenizer(model_dir), PROMPT, grid)
    return int(text_condition_mask(ids, config).sum()), grid.width, grid.height


def bounds_report(raw: dict, model_dir: Path, measured: dict) -> dict:
    """AR ms/token and DiT TFLOP/s per size, for the services at c1 and in process, against the machine's bounds
    (``bench.ratios``; ``python -m bench.dashboard --bounds`` re-states them against bounds measured later)."""
    from ar_service.model.configuration import ar_config_from_dict
    from servicekit.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(model_dir, require_weights=False)
    config = checkpoint.config
    ar_config = ar_config_from_dict(config)
    dtype_bytes = 2 if raw["dtype"] == "bfloat16" else 4
    weight_bytes = workload.decode_weight_bytes(ar_config, dtype_bytes)
    rows = []
    inprocess = {(p["size"], p["steps"]): p for p in (raw.get("inprocess") or {}).get("points", [])}
    for point in raw["points"]:
        size, steps = point["size"], point["steps"]
        c1 = next((r for r in point["runs"] if r["concurrency"] == 1 and r.get("stages_ms")), None)
        knobs = point.get("knobs") or {}
        text, grid_w, grid_h = text_positions(model_dir, size, GridRule.of(checkpoint.serving))
        flops = workload.denoise_flops(
            config, size, size, steps, text, grid_w, grid_h,
            guidance=float(knobs.get("text_guidance_scale", 9.0)), cfg_range=tuple(knobs.get("cfg_range", (0.0, 1.0))),
        )
        row: dict = {"size": size, "steps": steps, "dit_flops": flops}
        ip = inprocess.get((size, steps))
        for label, stages in (("service", c1["stages_ms"] if c1 else None), ("inprocess", ip["stages_mean"] if ip else None)):
            if stages is not None:
                row[f"{label}_ar_ms_per_token"] = stages["ar_ms_per_token"]
                row[f"{label}_dit_tflop_per_s"] = ratios.dit_tflop_per_s(flops["flops"], stages["denoise_ms"])
        rows.append(ratios.set_ratios(row, weight_bytes, measured))
    return {"measured": measured, "decode_weight_bytes": weight_bytes, "dtype_bytes": dtype_bytes, "per_size": rows}


def transport_overhead(raw: dict) -> list[dict]:
    rows = []
    inprocess = {(p["size"], p["steps"]): p for p in (raw.get("inprocess") or {}).get("points", [])}
    for point in raw["points"]:
        c1 = next((r for r in point["runs"] if r["concurrency"] == 1 and r.get("latency_s")), None)
        ip = inprocess.get((point["size"], point["steps"]))
        if c1 is None or ip is None:
            continue
        service = c1["latency_s"]["mean"]
        rows.append({"size": point["size"], "steps": point["steps"], "via": raw["via"], "service_c1_mean_s": service,
                     "inprocess_mean_s": ip["latency_s_mean"], "overhead": (service - ip["latency_s_mean"]) / service})
    return rows


def _engine_status(stack: ServiceStack) -> dict:
    try:
        return stack.engine_status()
    except Exception as exc:  # noqa: BLE001 - a status failure must not lose the point
        return {"error": repr(exc)}


def _engine_deltas(before: dict, after: dict) -> dict:
    """What each engine's ``*_total`` counters gained during the point (``largest_batch`` is since start)."""
    deltas = {}
    for engine in ("ar", "dit"):
        first, last = before.get(engine), after.get(engine)
        if isinstance(first, dict) and isinstance(last, dict):
            deltas[engine] = {k: last[k] - first[k] for k in last if k.endswith("_total") and k in first}
    return deltas


def sweep(args: argparse.Namespace, stack: ServiceStack, watch: GpuMemoryWatch, raw: dict) -> None:
    knobs = dict(args.knob)
    send = (GrpcClient(stack.ar_address, args.timeout_s, knobs) if args.via == "grpc"
            else RestClient(stack.url, args.timeout_s, knobs))
    next_seed = args.seed
    try:
        for size, steps in args.points:
            point = {"size": size, "steps": steps, "warmup": [], "runs": []}
            raw["points"].append(point)
            for _ in range(args.warmup):
                outcome = send(size, steps, args.seed + 1_000_000 + len(point["warmup"]), args.guidance)
                if outcome.error:
                    raise SystemExit(f"warm-up request at {size}x{size}/{steps} failed: {outcome.error}")
                point["warmup"].append({"latency_s": outcome.latency_s, "timings": outcome.timings})
                point["knobs"] = outcome.knobs
            c1_latency = point["warmup"][-1]["latency_s"] if point["warmup"] else 0.0
            for concurrency in [c for c in args.concurrency if c <= args.max_concurrency.get(size, c)]:
                requests = args.requests or max(4, 2 * concurrency)
                ramp = c1_latency / concurrency
                watch.lap()
                before = _engine_status(stack)
                print(f"[harness] {size}x{size}/{steps} steps, c{concurrency}: {requests} requests, ramp {ramp:.2f} s",
                      flush=True)
                outcomes = closed_loop(send, size, steps, concurrency, requests, ramp, next_seed, args.guidance)
                next_seed += requests
                run = {"concurrency": concurrency, "requests": requests, "ramp_s": ramp, **summarize(outcomes, concurrency),
                       "samples": [{"seed": o.seed, "start_s": o.start - outcomes[0].start, "latency_s": o.latency_s,
                                    "timings": o.timings, "error": o.error} for o in outcomes]}
                peaks = watch.lap()
                run["peak_gpu_mib"] = {name: peaks.get(pid) for name, pid in stack.pids.items()} if watch.available else None
                run["engines"] = _engine_status(stack)
                run["engine_counts"] = _engine_deltas(before, run["engines"])
                point["runs"].append(run)
                if "knobs" not in point:
                    point["knobs"] = next((o.knobs for o in outcomes if o.knobs), None)
                if concurrency == 1 and run.get("latency_s"):
                    c1_latency = run["latency_s"]["mean"]
                lat = run.get("latency_s") or {}
                print(f"[harness]   done {run['completed']}/{requests}, mean {lat.get('mean', float('nan')):.3f} s, "
                      f"p95 {lat.get('p95', float('nan')):.3f} s, {run.get('throughput_images_per_s') or 0:.3f} img/s "
                      f"(steady {run.get('steady_throughput_images_per_s') or 0:.3f})",
                      flush=True)
    finally:
        send.close()


def add_run_options(parser: argparse.ArgumentParser, knob_note: str = "") -> None:
    """What every benchmark that starts the services asks alike: the model, the device, the requests' seed,
    guidance and knobs, and their deadline (bench.harness, bench.saturation)."""
    note = f", {knob_note}" if knob_note else ""
    parser.add_argument("--seed", type=int, default=0, help="base seed; request k uses seed + k")
    parser.add_argument("--guidance", type=float, default=None, help="text_guidance_scale (default: the model's)")
    parser.add_argument("--knob", type=parse_knob, action="append", default=[],
                        help=f"KEY=VALUE (JSON value): a per-model knob sent with every request{note}; "
                             "repeatable (e.g. --knob ar_cfg_scale=1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny model with its own weights (e.g. --device cpu)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-bench"), help="where the model directory goes")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of one request (client and gateway)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.harness", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="directory for raw.json, DASHBOARD.md, dashboard.png and the services' logs (raw/)")
    parser.add_argument("--points", "--sizes", dest="points", type=parse_points, default=parse_points("512:20,1024:50"),
                        help="SIZE:STEPS pairs, comma-separated (default 512:20,1024:50)")
    parser.add_argument("--concurrency", type=parse_ints, default=parse_ints("1,2,4,8"), help="default 1,2,4,8")
    parser.add_argument("--max-concurrency", type=parse_size_limits, default={},
                        help="SIZE=C pairs, comma-separated: skip concurrencies above C at that size (e.g. 1024=2)")
    parser.add_argument("--requests", type=int, default=0, help="requests per point (default max(4, 2 * c))")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted requests per size before measuring")
    add_run_options(parser, knob_note="also in process")
    parser.add_argument("--via", choices=("rest", "grpc"), default="rest",
                        help="rest: the gateway's OpenAI API; grpc: ar_service's GenerateImage")
    parser.add_argument("--extra-ar", default="",
                        help="extra ar_service flags, space-separated, given after an = (--extra-ar=--deterministic)")
    parser.add_argument("--extra-dit", default="", help="extra dit_service flags, space-separated (as --extra-ar)")
    parser.add_argument("--env-ar", type=parse_env, default={},
                        help="KEY=VALUE pairs, comma-separated, set in ar_service's environment only "
                             "(e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40)")
    parser.add_argument("--env-dit", type=parse_env, default={}, help="the same for dit_service")
    parser.add_argument("--inprocess-requests", type=int, default=3, help="measured in-process images per size; 0 skips")
    parser.add_argument("--inprocess-decoder", choices=inprocess.DECODERS, default="auto",
                        help="AR decode path in process (auto: as ar_service's --fast-decode auto)")
    parser.add_argument("--no-bounds", action="store_true", help="skip the bandwidth and matmul measurements")
    parser.add_argument("--bounds-copy-mib", type=bounds.parse_mib, default=None,
                        help="copy sizes in MiB, comma-separated (default 256,1024,4096 on a GPU, 64,256 on a CPU)")
    parser.add_argument("--bounds-matmul", type=bounds.parse_shapes, default=None,
                        help="matmul shapes, N or MxKxN, comma-separated (default 4096,8192,16384x8192x8192 on a GPU)")
    bounds.add_settings_options(parser, "bounds-")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        bounds_settings = bounds.settings_from(args, "bounds-")
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    command = argv if argv is not None else sys.argv[1:]
    raw: dict = {
        "command": "python -m bench.harness " + shlex.join(command),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(args.device),
        "model": "tiny" if args.tiny else "preview-random",
        "dtype": dtype,
        "via": args.via,
        "prompt": PROMPT,
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "points": [],
    }
    raw_path = args.out / RAW_NAME
    measured = None
    if not args.no_bounds:  # first, on an idle device, and so that a run cut short still has them
        print("[harness] bounds", flush=True)
        measured = bounds.measure(args.device, args.bounds_matmul, args.bounds_copy_mib, bounds_settings)
        print(bounds.summary(measured), flush=True)
    model_dir = make_model_dir(args.workdir, args.tiny)
    stack = ServiceStack(
        model_dir, args.out / LOGS_DIR, device=args.device, random_weights=not args.tiny, request_timeout_s=args.timeout_s,
        extra_ar=args.extra_ar.split(), extra_dit=args.extra_dit.split(), env_ar=args.env_ar, env_dit=args.env_dit,
    )
    watch = GpuMemoryWatch()
    try:
        raw["startup_s"] = stack.start()
        print(f"[harness] services up in {raw['startup_s']:.1f} s", flush=True)
        raw["service_logs"] = {name: stack.log_lines(name, "ready") for name in ("ar_service", "dit_service")}
        sweep(args, stack, watch, raw)
    finally:
        stack.stop()
        peaks = watch.stop()
        raw["peak_gpu_mib"] = {name: peaks.get(pid) for name, pid in stack.pids.items()} if watch.available else None
        if measured is not None:
            raw["bounds"] = bounds_report(raw, model_dir, measured)
        raw_path.write_text(json.dumps(raw, indent=2) + "\n")  # whatever was measured survives a failure below

    if args.inprocess_requests > 0:
        print("[harness] in-process baseline", flush=True)
        raw["inprocess"] = inprocess.run(model_dir, args.points, PROMPT, seed=args.seed, requests=args.inprocess_requests,
                                         warmup=min(1, args.warmup), device=args.device, random_weights=not args.tiny,
                                         guidance=args.guidance, decoder=args.inprocess_decoder, knobs=dict(args.knob))
        raw["transport_overhead"] = transport_overhead(raw)
        if measured is not None:
            raw["bounds"] = bounds_report(raw, model_dir, measured)  # now with the in-process ratios too
    raw_path.write_text(json.dumps(raw, indent=2) + "\n")

    from bench import dashboard

    written = dashboard.write(raw, args.out)
    print(f"[harness] wrote {raw_path} and {', '.join(str(p) for p in written)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
