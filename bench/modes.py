"""Every speed mode side by side at the served grid, on one card in one run: one request at a time per mode and size,
the lossless check of speculative decoding, row-parallel's forward count against its formula, and what published
acceptance rates of trained models would make of the measured cost of a forward.

Usage (CUDA machine; the Preview-shaped skeleton with random bf16 weights built on the device)::

    python -m bench.modes --out DIR
    python -m bench.modes --render DIR/modes.json --saturation SAT1.json SAT2.json   # the page again, with more runs

and on a CPU with the tiny model: ``python -m bench.modes --out DIR --tiny --device cpu --sizes 128:2 --seeds 2``.

What one run does (``--stages``, default ``c1,lossless,fp8``), each stage against the three services started for it:

- ``c1`` (the services as they start by default): for each size SIZE:STEPS (``--sizes``, default ``512:20,1024:50``)
  one warm-up request, then ``--reps`` requests (seeds ``--seed`` + r, the same for every mode) of each mode in
  ``C1_MODES``, one at a time. Per mode and size: the client's latency, the services' stage timings, the grid, the
  AR forwards and the DiT steps computed, and each PNG's SHA-256 (equal to sequential's or not).
- ``lossless``: per size, ``--seeds`` images (one request, ``n`` = seeds, seed ``LOSSLESS_SEED`` + i) decoded
  sequentially, then speculatively (window 8) alone on the server, then speculatively (windows 8 and 16) among
  concurrent requests of other modes and sizes (``CONCURRENT``: their images share the AR's decode steps, so the
  speculative rows sit beside rows of other lane counts). Every speculative PNG must be byte-identical to the
  sequential one of its size and seed; every row-parallel request must take its formula's forwards
  (``RowParallel.forwards``). ``--lossless-steps`` DiT steps (default 20) at both sizes: the check is of the AR's
  grid, the DiT is deterministic for a condition.
- ``fp8``: the services again with dit_service in FP8 (``--quantization fp8``): the FP8 DiT alone and the combinations
  in ``FP8_MODES``, as ``c1`` measures them.

- ``saturation``: the services with ``bench.saturation``'s settings for many streams and dit_service in FP8, then for
  each ``--saturation-points`` SIZE:STEPS:CLIENTS (default ``512:20:16``) a closed loop of sequential requests and one
  of ``SATURATION_MODES`` (``bench.saturation.run_point``: warm-up, then a window of at most
  ``--saturation-window-s``): one start for both, so each mode is measured against sequential decoding on the
  same services. ``--saturation FILE`` puts other ``bench.saturation`` runs on the page too.

``--ar-arg`` / ``--dit-arg`` add a flag to one service in every stage, after the stage's own (a later flag wins:
``--dit-arg=--max-batch-size=2``).

Writes ``OUT/modes.json`` (every request) and ``OUT/MODES.md``.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ar_service.decoding.modes import RowParallel
from ar_service.prompt import Grid
from bench import saturation as sat
from bench.harness import machine_info, request_body
from bench.inprocess import parse_points
from bench.markdown import fmt, table, verdict
from bench.saturation_report import busy_s_per_image, littles_law
from bench.services import ServiceStack, make_model_dir

RESULT_NAME = "modes.json"
MARKDOWN_NAME = "MODES.md"
GENERATIONS_PATH = "/v1/images/generations"
SEQUENTIAL = "sequential"

#: The c1 rows: a label and the knobs every request of the row sends (the services' defaults otherwise).
C1_MODES: list[tuple[str, dict]] = [
    (SEQUENTIAL, {}),
    ("speculative, window 8", {"ar_decoding": "speculative", "ar_decoding_window": 8}),
    ("speculative, window 16", {"ar_decoding": "speculative", "ar_decoding_window": 16}),
    ("row_parallel, window 2", {"ar_decoding": "row_parallel", "ar_decoding_window": 2}),
    ("row_parallel, window 4", {"ar_decoding": "row_parallel", "ar_decoding_window": 4}),
    ("step caching 0.05", {"dit_cache_threshold": 0.05}),
    ("step caching 0.1", {"dit_cache_threshold": 0.1}),
]
FASTEST = "FP8 DiT + row_parallel w4 + caching 0.1"
#: The rows measured with dit_service in FP8.
FP8_MODES: list[tuple[str, dict]] = [
    ("FP8 DiT", {}),
    ("FP8 DiT + caching 0.1", {"dit_cache_threshold": 0.1}),
    (FASTEST, {"ar_decoding": "row_parallel", "ar_decoding_window": 4, "dit_cache_threshold": 0.1}),
    ("FP8 DiT + row_parallel w2 + caching 0.1",
     {"ar_decoding": "row_parallel", "ar_decoding_window": 2, "dit_cache_threshold": 0.1}),
]
#: The saturation stage's rows: each point once per entry (dit_service in FP8 for both).
SATURATION_MODES: list[tuple[str, dict]] = [
    (SEQUENTIAL, {}),
    ("row_parallel w4 + caching 0.1", {"ar_decoding": "row_parallel", "ar_decoding_window": 4,
                                       "dit_cache_threshold": 0.1}),
]
LOSSLESS_SEED = 1000
SPECULATIVE_8 = {"ar_decoding": "speculative", "ar_decoding_window": 8}
SPECULATIVE_16 = {"ar_decoding": "speculative", "ar_decoding_window": 16}
#: Published speed-ups of training-free speculative decoding on trained AR text-to-image models (fewer forwards than
#: sequential decoding, MS-COCO captions): SJD (arXiv 2410.01699, ICLR 2025) 2.22x on Lumina-mGPT and 2.32x on Emu3;
#: SJD-PAC (arXiv 2603.18599) 4.51x and 4.31x. Higher guidance lowers them (those runs: CFG 3).
PUBLISHED_ACCEPTANCE: list[tuple[str, float]] = [("SJD (Lumina-mGPT 2.22x, Emu3 2.32x)", 2.2),
                                                 ("SJD-PAC (Lumina-mGPT 4.51x, Emu3 4.31x)", 4.5)]
#: The targets this page checks (seconds at one request; images/s at saturation).
TARGET_SEQUENTIAL_1024_S = 9.5
TARGET_FASTEST_1024_S = 3.0
TARGET_SATURATION_SEQUENTIAL = 1.0
TARGET_SATURATION_MODES = 4.0


@dataclass
class Answer:
    """One request's answer: latency, the services' timings, each image's PNG digest, or the error."""

    label: str
    size: int
    steps: int
    seed: int
    n: int
    knobs: dict
    latency_s: float = 0.0
    timings: dict | None = None
    digests: list[str] | None = None
    error: str | None = None

    def record(self) -> dict:
        return {"label": self.label, "size": self.size, "steps": self.steps, "seed": self.seed, "n": self.n,
                "knobs": self.knobs, "latency_s": self.latency_s, "timings": self.timings, "digests": self.digests,
                "error": self.error}


def send(http: httpx.Client, label: str, size: int, steps: int, seed: int, knobs: dict, n: int = 1) -> Answer:
    """POSTs one generation (b64_json PNGs) and keeps what the report needs."""
    answer = Answer(label, size, steps, seed, n, dict(knobs))
    body = {**request_body(size, steps, seed, None, knobs), "n": n, "response_format": "b64_json", "output_format": "png"}
    start = time.perf_counter()
    try:
        response = http.post(GENERATIONS_PATH, json=body)
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
        return answer
    answer.latency_s = time.perf_counter() - start
    if response.status_code != 200:
        answer.error = f"HTTP {response.status_code}: {response.text[:300]}"
        return answer
    result = response.json()
    answer.timings = result.get("timings")
    answer.digests = [hashlib.sha256(base64.b64decode(item["b64_json"])).hexdigest() for item in result["data"]]
    return answer


def run_c1(http: httpx.Client, sizes, modes: list[tuple[str, dict]], reps: int, seed: int, warm_up: bool) -> list[dict]:
    """Each mode's ``reps`` requests per size, one at a time (a warm-up request per size first when asked)."""
    answers = []
    for size, steps in sizes:
        if warm_up:
            send(http, "warm-up", size, steps, seed + 10_000, {})
        for label, knobs in modes:
            for rep in range(reps):
                answer = send(http, label, size, steps, seed + rep, knobs)
                _print(answer)
                answers.append(answer.record())
    return answers


def run_lossless(http: httpx.Client, sizes, seeds: int, steps: int) -> list[dict]:
    """Sequential references, speculative alone, then speculative among concurrent requests of other modes/sizes."""
    answers: list[Answer] = []
    for size, _ in sizes:
        answers.append(send(http, f"reference {SEQUENTIAL}", size, steps, LOSSLESS_SEED, {}, n=seeds))
        answers.append(send(http, "speculative w8, alone", size, steps, LOSSLESS_SEED, SPECULATIVE_8, n=seeds))
    small, large = sizes[0][0], sizes[-1][0]
    concurrent = [
        ("speculative w8, among others", small, LOSSLESS_SEED, SPECULATIVE_8, seeds),
        ("speculative w16, among others", large, LOSSLESS_SEED, SPECULATIVE_16, seeds),
        ("row_parallel w4, among others", large, 2000, {"ar_decoding": "row_parallel", "ar_decoding_window": 4}, 2),
        ("row_parallel w2, among others", small, 3000, {"ar_decoding": "row_parallel", "ar_decoding_window": 2}, 2),
        ("sequential, among others", large, 4000, {}, 2),
        ("speculative w16, among others", small, LOSSLESS_SEED, SPECULATIVE_16, seeds),
        ("speculative w8, among others", large, LOSSLESS_SEED, SPECULATIVE_8, seeds),
    ]
    done: list[Answer | None] = [None] * len(concurrent)

    def one(i: int) -> None:
        label, size, seed, knobs, n = concurrent[i]
        time.sleep(0.05 * i)  # in this order, all in flight together
        done[i] = send(http, label, size, steps, seed, knobs, n=n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(concurrent))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers += [a for a in done if a is not None]
    for answer in answers:
        _print(answer)
    return [a.record() for a in answers]


def lossless_verdict(answers: list[dict], grids: dict[int, Grid]) -> dict:
    """Every speculative image against the sequential reference of its size and seed, and every row-parallel
    request's forwards against its formula. ``grids``: the grid the services used per size (from the answers)."""
    reference: dict[tuple[int, int], str] = {}
    for a in answers:
        if a["label"].startswith("reference") and a["digests"]:
            for i, digest in enumerate(a["digests"]):
                reference[a["size"], a["seed"] + i] = digest
    compared = identical = 0
    mismatches = []
    forwards = []
    for a in answers:
        knobs = a["knobs"]
        if a["error"]:
            mismatches.append(f"{a['label']} at {a['size']}: {a['error']}")
            continue
        if knobs.get("ar_decoding") == "speculative":
            for i, digest in enumerate(a["digests"] or []):
                expected = reference.get((a["size"], a["seed"] + i))
                if expected is None:
                    continue
                compared += 1
                if digest == expected:
                    identical += 1
                else:
                    mismatches.append(f"{a['label']} at {a['size']}, seed {a['seed'] + i}")
        if knobs.get("ar_decoding") == "row_parallel" and a["size"] in grids:
            expected_forwards = RowParallel.forwards(grids[a["size"]], knobs["ar_decoding_window"]) * a["n"]
            got = (a["timings"] or {}).get("ar_forwards")
            forwards.append({"label": a["label"], "size": a["size"], "images": a["n"], "forwards": got,
                             "formula": expected_forwards, "match": got == expected_forwards})
    return {"compared": compared, "identical": identical, "mismatches": mismatches, "row_parallel": forwards,
            "pass": compared > 0 and identical == compared and not mismatches and all(f["match"] for f in forwards)}


def _print(answer: Answer) -> None:
    t = answer.timings or {}
    print(f"[modes] {answer.label:<44} {answer.size}/{answer.steps} seed {answer.seed} n {answer.n}: "
          + (answer.error or f"{answer.latency_s:.2f} s, AR {t.get('ar_decode_ms', 0) / 1e3:.2f} s in "
             f"{t.get('ar_forwards')} forwards, denoise {t.get('denoise_ms', 0) / 1e3:.2f} s"), flush=True)


def saturation_service_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """ar_service's and dit_service's flags for the saturation stage: bench.saturation's for many streams,
    dit_service in FP8 on CUDA, then the command line's (a later flag wins)."""
    fp8 = ["--quantization", "fp8"] if args.device.startswith("cuda") else []  # FP8 needs Ada or Hopper
    return ([*sat.SATURATION_AR_ARGS, *args.service_arg, *args.ar_arg],
            [*sat.SATURATION_DIT_ARGS, *fp8, *args.service_arg, *args.dit_arg])


def run_saturation(args: argparse.Namespace, model_dir: Path) -> dict:
    """The saturation stage: one start of the services for many streams, each point once per SATURATION_MODES."""
    from bench.services import GpuMemoryWatch, free_port

    ar_metrics, dit_metrics = free_port(), free_port()
    extra_ar, extra_dit = saturation_service_args(args)
    fp8 = sat.precision_label(extra_dit, "") == "fp8"
    extra_ar += ["--metrics-port", str(ar_metrics)]
    extra_dit += ["--metrics-port", str(dit_metrics)]
    run: dict = {"label": "AR bf16, DiT FP8" if fp8 else args.device, "points": [],
                 "service_args": {"ar_service": extra_ar, "dit_service": extra_dit}}
    stack = ServiceStack(model_dir, args.out / "logs" / "saturation", device=args.device, random_weights=not args.tiny,
                         request_timeout_s=args.timeout_s, extra_ar=extra_ar, extra_dit=extra_dit)
    metrics = {"ar": f"http://127.0.0.1:{ar_metrics}/metrics", "dit": f"http://127.0.0.1:{dit_metrics}/metrics"}
    watch = GpuMemoryWatch()
    try:
        run["startup_s"] = stack.start()
        run["service_logs"] = {name: stack.log_lines(name, "ready", "fast decode", "decode kernels", "decode memory")
                               for name in ("ar_service", "dit_service")}
        seed = 50_000
        for point in sat.parse_points(args.saturation_points):
            for label, knobs in SATURATION_MODES:
                options = argparse.Namespace(
                    knob=list(knobs.items()), guidance=None, ramp_s=0.0, warmup_s=15.0, max_warmup_s=240.0,
                    window_s=args.saturation_window_s, window_latencies=2.0, max_window_s=args.saturation_window_s,
                    timeout_s=args.timeout_s)
                measured = sat.run_point(options, stack, metrics, watch, point, seed)
                measured["mode"] = label
                seed += measured["requests_sent"]
                run["points"].append(measured)
    finally:
        stack.stop()
        watch.stop()
    return run


# -- the page ----------------------------------------------------------------------------------------------------------


def summarize(answers: list[dict]) -> list[dict]:
    """Per (label, size): means of the latency and stages, the grid, and how many PNGs equal sequential's."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for a in answers:
        if a["label"] != "warm-up":
            groups.setdefault((a["label"], a["size"]), []).append(a)
    sequential = {(a["size"], a["seed"]): a["digests"] for a in answers if a["label"] == SEQUENTIAL and a["digests"]}
    rows = []
    for (label, size), group in groups.items():
        done = [a for a in group if not a["error"]]
        row: dict = {"label": label, "size": size, "steps": group[0]["steps"], "requests": len(group),
                     "failed": len(group) - len(done), "knobs": group[0]["knobs"]}
        if done:
            def mean(key: str, scale: float = 1.0, of: list[dict] = done) -> float | None:
                values = [a["timings"][key] for a in of if a["timings"] and key in a["timings"]]
                return statistics.fmean(values) * scale if values else None

            row.update(latency_s=statistics.fmean(a["latency_s"] for a in done), ar_decode_s=mean("ar_decode_ms", 1e-3),
                       denoise_s=mean("denoise_ms", 1e-3), ar_forwards=mean("ar_forwards"), ar_tokens=mean("ar_tokens"),
                       steps_computed=mean("dit_steps_computed"), steps_skipped=mean("dit_steps_skipped"),
                       grid=_grid_text(done[0]["timings"]))
            if row["ar_forwards"]:
                row["ms_per_forward"] = row["ar_decode_s"] * 1e3 / row["ar_forwards"]
            same = [a["digests"] == sequential.get((size, a["seed"])) for a in done if (size, a["seed"]) in sequential]
            row["same_png_as_sequential"] = f"{sum(same)}/{len(same)}" if same else None
        rows.append(row)
    return rows


def _grid_text(timings: dict | None) -> str | None:
    if not timings or not timings.get("ar_grid_width"):
        return None
    return f"{timings['ar_grid_width']}x{timings['ar_grid_height']}"


def grids_of(answers: list[dict]) -> dict[int, Grid]:
    """The grid each size was decoded at, as the answers' timings state it."""
    grids = {}
    for a in answers:
        t = a.get("timings") or {}
        if t.get("ar_grid_width"):
            grids[a["size"]] = Grid(int(t["ar_grid_width"]), int(t["ar_grid_height"]))
    return grids


def projections(rows: list[dict]) -> list[dict]:
    """Time per image if a trained model accepted as the published ones do: the sequential forwards divided by the
    published speed-up, times this run's measured cost of a speculative window-8 forward, plus what the rest of the
    pipeline took in the sequential row (and in the fastest row's DiT settings). Arithmetic on measured parts, not a
    measurement."""
    by = {(r["label"], r["size"]): r for r in rows}
    out = []
    for size in sorted({r["size"] for r in rows}):
        seq, spec = by.get((SEQUENTIAL, size)), by.get(("speculative, window 8", size))
        if not seq or not spec or not seq.get("ar_forwards") or not spec.get("ms_per_forward"):
            continue
        rest = seq["latency_s"] - seq["ar_decode_s"]
        fastest = by.get((FASTEST, size))
        fast_rest = fastest["latency_s"] - fastest["ar_decode_s"] if fastest and fastest.get("ar_decode_s") else None
        for name, speedup in PUBLISHED_ACCEPTANCE:
            decode = seq["ar_forwards"] / speedup * spec["ms_per_forward"] / 1e3
            out.append({"size": size, "steps": seq["steps"], "acceptance": name, "speedup": speedup,
                        "forwards": seq["ar_forwards"] / speedup, "ms_per_forward": spec["ms_per_forward"],
                        "ar_decode_s": decode, "wall_s": rest + decode,
                        "wall_fp8_cache_s": None if fast_rest is None else fast_rest + decode})
    return out


def render(report: dict, saturation: list[dict] | None = None) -> str:
    machine = report.get("machine", {})
    card = machine.get("gpu") or machine.get("device", "?")
    lines = [f"# Speed modes at the served grid: {card}", "",
             f"One run, one card ({card}; torch {machine.get('torch', '?')}), {report.get('date', '?')}: "
             f"`{report.get('command', '')}`. Model: {report.get('model', '?')} (random weights where Preview-shaped: "
             "timings, not pictures). Every row against sequential decoding in the same run.", ""]
    rows = summarize(report.get("c1", []) + report.get("fp8", []))
    lines += ["## One request at a time", ""]
    lines += table(
        ["mode", "size/steps", "grid", "requests", "wall s", "AR decode s", "AR forwards", "ms per forward",
         "denoise s", "DiT steps computed / skipped", "same PNG as sequential"],
        [[r["label"], f"{r['size']}/{r['steps']}", r.get("grid"), f"{r['requests'] - r['failed']}/{r['requests']}",
          r.get("latency_s"), r.get("ar_decode_s"), r.get("ar_forwards"), r.get("ms_per_forward"), r.get("denoise_s"),
          f"{fmt(r.get('steps_computed'), 1)} / {fmt(r.get('steps_skipped'), 1)}", r.get("same_png_as_sequential")]
         for r in sorted(rows, key=lambda r: (r["size"], r["label"] != SEQUENTIAL))])
    projected = projections(rows)
    if projected:
        lines += ["", "## Projection (not measured): published acceptance times this run's cost of a forward", "",
                  "Random weights accept almost no drafts, so speculative decoding's speed-up here says nothing about "
                  "a trained model. These rows divide the sequential forwards by the speed-ups published for "
                  "training-free speculative decoding on trained AR text-to-image models (MS-COCO, CFG 3) and multiply by "
                  "the measured time of a window-8 speculative forward; the rest of the pipeline as measured (sequential "
                  "DiT; and the FP8 + caching 0.1 DiT of the fastest row).", ""]
        lines += table(["size/steps", "published speed-up", "forwards", "ms per forward (measured)",
                        "AR decode s (projected)", "wall s (projected)", "with FP8 DiT + caching 0.1 (projected)"],
                       [[f"{p['size']}/{p['steps']}", p["acceptance"], p["forwards"], p["ms_per_forward"],
                         p["ar_decode_s"], p["wall_s"], p["wall_fp8_cache_s"]] for p in projected])
    check = report.get("lossless_verdict")
    if check:
        lines += ["", "## Lossless check", "",
                  f"Speculative PNGs byte-identical to sequential: {check['identical']}/{check['compared']} "
                  f"({'pass' if check['pass'] else 'FAIL'}); {report.get('lossless_steps')} DiT steps. Requests:", ""]
        lines += table(["request", "size", "images", "seeds", "wall s", "AR forwards"],
                       [[a["label"], a["size"], a["n"], f"{a['seed']}..{a['seed'] + a['n'] - 1}", a["latency_s"],
                         (a["timings"] or {}).get("ar_forwards")] for a in report.get("lossless", [])])
        if check["mismatches"]:
            lines += ["", "Mismatches: " + "; ".join(check["mismatches"])]
        if check["row_parallel"]:
            lines += ["", "Row-parallel forwards against `(H - 1) * min(window, W) + W` per image:", ""]
            lines += table(["request", "size", "images", "forwards", "formula", "match"],
                           [[f["label"], f["size"], f["images"], f["forwards"], f["formula"], f["match"]]
                            for f in check["row_parallel"]])
    lines += ["", "## Targets", ""]
    lines += table(["target", "measured", "verdict"], targets(rows, saturation or []))
    if saturation:
        lines += ["", "## Saturation (bench.saturation, closed loops)", ""]
        lines += table(["run", "size/steps", "clients", "knobs", "images/s", "clients / mean latency", "p50 s", "p95 s",
                        "AR forwards / image", "AR busy s / image", "DiT busy s / image", "window s"],
                       [[run.get("label") or run.get("precision"), f"{p['size']}/{p['steps']}", p["clients"],
                         _knob_text(p.get("knobs")), p.get("throughput_images_per_s"), littles_law(p),
                         (p.get("latency_s") or {}).get("p50"), (p.get("latency_s") or {}).get("p95"),
                         (p.get("stages_ms") or {}).get("ar_forwards"), busy_s_per_image(p, "ar"),
                         busy_s_per_image(p, "dit"), p.get("window_s")]
                        for run in saturation for p in run.get("points", [])])
        lines += ["", "images/s counts the requests that ended inside the window; with clients that move in step and a "
                      "window of one or two latencies that count depends on where the window falls. \"clients / mean "
                      "latency\" is Little's law for the closed loop, which has no such step (`bench.saturation_report`). "
                      "The targets read images/s. \"busy s / image\" is an engine's share of the window spent in its "
                      "steps over images/s: with both services on one card, N images/s needs each under 1/N s, and "
                      "their sum under 1/N s as far as they do not run at once."]
    return "\n".join(lines) + "\n"


def saturation_runs(report: dict, others: list[dict]) -> list[dict]:
    """The saturation runs a page shows: the report's own stage, if it ran one, then the bench.saturation results
    named on the command line."""
    return ([report["saturation"]] if report.get("saturation") else []) + others


def _knob_text(knobs: dict | None) -> str:
    wanted = ("ar_decoding", "ar_decoding_window", "dit_cache_threshold")
    return ", ".join(f"{k} {knobs[k]}" for k in wanted if knobs and k in knobs) or "-"


def targets(rows: list[dict], saturation: list[dict]) -> list[list]:
    by = {(r["label"], r["size"], r["steps"]): r for r in rows}
    seq = (by.get((SEQUENTIAL, 1024, 50)) or {}).get("latency_s")
    fast = (by.get((FASTEST, 1024, 50)) or {}).get("latency_s")
    out = [[f"1024x1024/50, one request, sequential <= {TARGET_SEQUENTIAL_1024_S} s", seq,
            verdict(seq, seq is not None and seq <= TARGET_SEQUENTIAL_1024_S)],
           [f"1024x1024/50, one request, {FASTEST} <= {TARGET_FASTEST_1024_S} s", fast,
            verdict(fast, fast is not None and fast <= TARGET_FASTEST_1024_S)]]
    seq_sat = modes_sat = None
    for run in saturation:
        for p in run.get("points", []):
            if (p["size"], p["steps"], p["clients"]) != (512, 20, 16):
                continue
            rate = p.get("throughput_images_per_s")
            if (p.get("knobs") or {}).get("ar_decoding", SEQUENTIAL) == SEQUENTIAL and not (p.get("knobs") or {}).get(
                    "dit_cache_threshold"):
                seq_sat = rate if seq_sat is None else max(seq_sat, rate or 0)
            else:
                modes_sat = rate if modes_sat is None else max(modes_sat, rate or 0)
    out += [[f"512x512/20, 16 clients, sequential >= {TARGET_SATURATION_SEQUENTIAL} images/s", seq_sat,
             verdict(seq_sat, seq_sat is not None and seq_sat >= TARGET_SATURATION_SEQUENTIAL)],
            [f"512x512/20, 16 clients, with the speed modes >= {TARGET_SATURATION_MODES} images/s", modes_sat,
             verdict(modes_sat, modes_sat is not None and modes_sat >= TARGET_SATURATION_MODES)]]
    return out


# -- the run -------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"directory for {RESULT_NAME}, {MARKDOWN_NAME} and the services' logs")
    parser.add_argument("--stages", default="c1,lossless,fp8",
                        help="comma-separated: c1, lossless, fp8, saturation")
    parser.add_argument("--saturation-points", default="512:20:16", help="SIZE:STEPS:CLIENTS,... of the saturation stage")
    parser.add_argument("--saturation-window-s", type=float, default=45.0, help="longest measured window per point")
    parser.add_argument("--sizes", type=parse_points, default=parse_points("512:20,1024:50"), help="SIZE:STEPS,...")
    parser.add_argument("--reps", type=int, default=2, help="requests per mode and size at c1")
    parser.add_argument("--seed", type=int, default=0, help="first seed of the c1 requests")
    parser.add_argument("--seeds", type=int, default=8, help="images per size in the lossless check")
    parser.add_argument("--lossless-steps", type=int, default=20, help="DiT steps of the lossless check's requests")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (its own weights) instead of Preview's shapes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ardit-bench"), help="where the model directory goes")
    parser.add_argument("--service-arg", action="append", default=[], help="a flag for both model services")
    parser.add_argument("--ar-arg", action="append", default=[], help="a flag for ar_service only (repeatable)")
    parser.add_argument("--dit-arg", action="append", default=[], help="a flag for dit_service only (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--render", type=Path, help="only write the page again from this modes.json")
    parser.add_argument("--saturation", type=Path, nargs="*", default=[], help="bench.saturation results to show")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with ``--ar-arg --flag`` taken as ``--ar-arg=--flag`` (as bench.saturation takes it)."""
    return build_parser().parse_args(sat.join_pass_through(argv))


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(command)
    saturation = [json.loads(path.read_text()) for path in args.saturation]
    if args.render:
        out = args.out or args.render.parent
        report = json.loads(args.render.read_text())
        (out / MARKDOWN_NAME).write_text(render(report, saturation_runs(report, saturation)))
        print(f"[modes] wrote {out / MARKDOWN_NAME}")
        return 0
    if args.out is None:
        raise SystemExit("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - {"c1", "lossless", "fp8", "saturation"}
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; known: c1, lossless, fp8, saturation")
    report: dict = {"command": "python -m bench.modes " + shlex.join(command),
                    "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine_info(args.device),
                    "model": "tiny" if args.tiny else "preview-random", "sizes": args.sizes,
                    "lossless_steps": args.lossless_steps, "startup_s": {}}
    model_dir = make_model_dir(args.workdir, args.tiny)
    path = args.out / RESULT_NAME

    def stack_for(name: str, extra_dit: list[str]) -> ServiceStack:
        return ServiceStack(model_dir, args.out / "logs" / name, device=args.device, random_weights=not args.tiny,
                            request_timeout_s=args.timeout_s, extra_ar=[*args.service_arg, *args.ar_arg],
                            extra_dit=[*args.service_arg, *extra_dit, *args.dit_arg])

    if "c1" in stages or "lossless" in stages:
        stack = stack_for("default", [])
        try:
            report["startup_s"]["default"] = stack.start()
            with httpx.Client(base_url=stack.url, timeout=args.timeout_s) as http:
                if "c1" in stages:
                    report["c1"] = run_c1(http, args.sizes, C1_MODES, args.reps, args.seed, warm_up=True)
                    path.write_text(json.dumps(report, indent=2) + "\n")
                if "lossless" in stages:
                    report["lossless"] = run_lossless(http, args.sizes, args.seeds, args.lossless_steps)
                    report["lossless_verdict"] = lossless_verdict(report["lossless"], grids_of(report["lossless"]))
                    print(f"[modes] lossless: {report['lossless_verdict']}", flush=True)
        finally:
            stack.stop()
            path.write_text(json.dumps(report, indent=2) + "\n")
    if "fp8" in stages:
        stack = stack_for("fp8-dit", ["--quantization", "fp8"])
        try:
            report["startup_s"]["fp8-dit"] = stack.start()
            with httpx.Client(base_url=stack.url, timeout=args.timeout_s) as http:
                report["fp8"] = run_c1(http, args.sizes, FP8_MODES, args.reps, args.seed, warm_up=True)
        finally:
            stack.stop()
            path.write_text(json.dumps(report, indent=2) + "\n")
    if "saturation" in stages:
        report["saturation"] = run_saturation(args, model_dir)
        path.write_text(json.dumps(report, indent=2) + "\n")
    (args.out / MARKDOWN_NAME).write_text(render(report, saturation_runs(report, saturation)))
    print(f"[modes] wrote {path} and {args.out / MARKDOWN_NAME}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
