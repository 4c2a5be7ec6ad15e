"""The saturation section of the dashboard: the closed-loop points of ``bench.saturation`` runs and the project's
throughput targets, each marked pass or FAIL, or "not measured" until a result file has the point.

``python -m bench.saturation_report BF16.json [FP8.json ...] [--out FILE]`` (FILE defaults to ``SATURATION.md``
beside the first file); ``bench.saturation`` writes it for its own run. Rows are keyed by precision and point; a
later file's row replaces an earlier one's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import markdown

MARKDOWN_NAME = "SATURATION.md"
PRECISIONS = ("bf16", "fp8")
STANDARD_POINTS = ((512, 20, 16), (512, 20, 32), (1024, 50, 8))
#: Before this work: 512x512/20 at c8, images completed while all 8 clients were active over that window
#: (bench/results/h200/raw.json, steady_throughput_images_per_s; bench/results/h200/NOTES.md).
BASELINE_512_C8_IMAGES_PER_S = 0.852
#: The throughput targets: (size, steps, clients, precision) -> least steady images/s.
TARGETS = {(512, 20, 16, "bf16"): 1.5, (512, 20, 16, "fp8"): 2.5}
NOT_MEASURED = "not measured"
#: A window in which no request ended (shorter than one latency, before bench.saturation's MIN_WINDOW_LATENCIES):
#: it measured no throughput, not a throughput of zero.
NONE_ENDED = "none ended in the window"


def _throughput(point: dict) -> float | None:
    """The point's window count in images/s; None when no request ended inside the window."""
    return None if point.get("completed") == 0 and point.get("failed") == 0 else point.get("throughput_images_per_s")


def _key(point: dict, precision: str) -> tuple[int, int, int, str]:
    return point["size"], point["steps"], point["clients"], precision


def collect(results: list[dict]) -> dict[tuple[int, int, int, str], dict]:
    rows = {}
    for result in results:
        for point in result.get("points", []):
            rows[_key(point, result.get("precision", "bf16"))] = point
    return rows


def _point_name(size: int, steps: int, clients: int) -> str:
    return f"{size}x{size}/{steps}, c{clients}"


def _ordered_keys(rows: dict) -> list[tuple[int, int, int, str]]:
    keys = [(*point, precision) for precision in PRECISIONS for point in STANDARD_POINTS]
    keys += sorted(k for k in rows if k not in keys)
    return keys


def targets_table(rows: dict) -> list[str]:
    return markdown.table(["target", "measured", "verdict"], target_rows(rows))


def target_rows(rows: dict) -> list[list[str]]:
    """[target, measured, verdict] for each throughput target."""
    table = []
    for (size, steps, clients, precision), least in TARGETS.items():
        point = rows.get((size, steps, clients, precision))
        label = f"{_point_name(size, steps, clients)} steady throughput, {precision} >= {least} img/s"
        if precision == "bf16":
            label += f" ({BASELINE_512_C8_IMAGES_PER_S} img/s at c8 before)"
        value = None if point is None else _throughput(point)
        if value is None:
            table.append([label, NOT_MEASURED if point is None else NONE_ENDED, NOT_MEASURED])
            continue
        p95 = (point.get("latency_s") or {}).get("p95")
        measured = f"{value:.3f} img/s (p50 {markdown.fmt((point.get('latency_s') or {}).get('p50'), 2)} s, p95 {markdown.fmt(p95, 2)} s)"
        table.append([label, measured, "pass" if value >= least else "FAIL"])
    return table


def points_table(rows: dict) -> list[str]:
    table = []
    for size, steps, clients, precision in _ordered_keys(rows):
        point = rows.get((size, steps, clients, precision))
        name = _point_name(size, steps, clients)
        if point is None:
            table.append([precision, name, NOT_MEASURED, "-", "-", "-", "-", "-", "-", "-", "-"])
            continue
        lat = point.get("latency_s") or {}
        images_per_s = _throughput(point)
        table.append([precision, name, NONE_ENDED if images_per_s is None else images_per_s, littles_law(point),
                      point["completed"], point["window_s"], lat.get("mean"), lat.get("p50"), lat.get("p95"),
                      lat.get("p99"), point["failed"]])
    return markdown.table(["precision", "point", "images/s", "clients / mean s", "images in window", "window s", "mean s",
                   "p50 s", "p95 s", "p99 s", "failed"], table)


def littles_law(point: dict) -> float | None:
    """Images/s as clients over the window's mean latency (Little's law for a closed loop with no think time). The
    window's count moves in steps of a DiT batch (up to 8 images end together), so over a 45 s window it can be off
    by ~0.2 images/s; this figure does not have that step."""
    mean = (point.get("latency_s") or {}).get("mean")
    return point["clients"] / mean if mean else None


def busy_s_per_image(point: dict, engine: str) -> float | None:
    """Seconds an engine ("ar" or "dit") spent in its steps per image that ended in the window: its busy share over
    images/s. On one card the two engines' figures add up to the card's time per image where they do not overlap, so
    a throughput target of N images/s needs each under 1/N."""
    busy = ((point.get("batching") or {}).get(engine) or {}).get("busy_fraction")
    images_per_s = point.get("throughput_images_per_s")
    return busy / images_per_s if busy is not None and images_per_s else None


def batching_table(rows: dict) -> list[str]:
    table = []
    for key in _ordered_keys(rows):
        point = rows.get(key)
        if point is None:
            continue
        b = point.get("batching") or {}
        ar, dit = b.get("ar") or {}, b.get("dit") or {}
        engines = point.get("engines") or {}
        table.append([key[3], _point_name(*key[:3]), ar.get("streams_per_step"), ar.get("step_ms"),
                      ar.get("busy_fraction"), dit.get("images_per_step"), dit.get("step_ms"), dit.get("busy_fraction"),
                      dit.get("batch_windows"), dit.get("batch_window_ms"),
                      (engines.get("ar") or {}).get("largest_batch"), (engines.get("dit") or {}).get("largest_batch")])
    return markdown.table(["precision", "point", "AR streams/step", "AR step ms", "AR busy", "DiT images/step", "DiT step ms",
                   "DiT busy", "DiT windows", "DiT window mean ms", "AR largest batch", "DiT largest batch"], table)


STAGES = ("ar_prefill_ms", "ar_decode_ms", "ar_ms_per_token", "condition_transfer_ms", "dit_queue_ms", "denoise_ms",
          "vae_decode_ms", "encode_ms", "gateway_ms", "total_ms", "client_unaccounted_ms")


def stages_table(rows: dict) -> list[str]:
    table = []
    for key in _ordered_keys(rows):
        point = rows.get(key)
        if point is None or not point.get("stages_ms"):
            continue
        stages = point["stages_ms"]
        table.append([key[3], _point_name(*key[:3]), *(stages.get(name) for name in STAGES)])
    return markdown.table(["precision", "point", "AR prefill", "AR decode", "AR ms/token", "cond. transfer", "DiT queue",
                   "denoise", "VAE decode", "encode", "gateway", "service total", "client unaccounted"], table)


def render(results: list[dict]) -> str:
    rows = collect(results)
    lines = ["# Throughput at saturation", ""]
    for result in results:
        gpu = (result.get("machine") or {}).get("gpu") or (result.get("machine") or {}).get("device", "?")
        lines.append(f"- {result.get('precision', '?')}: `{result.get('command', '?')}` on {gpu}, {result.get('date', '?')}, "
                     f"model {result.get('model', '?')}")
        for service, flags in (result.get("service_args") or {}).items():
            lines.append(f"  - {service}: `{' '.join(flags)}`")
    lines += [
        "",
        "Closed loops: each client sends its next request when its previous one returns, through the gateway. "
        "Images/s = images whose request ended inside the measured window, over the window (after a warm-up that lasts "
        "until every client has had an answer); latencies are those requests' client latencies. Clients / mean s: "
        "the same throughput by Little's law, free of the window count's steps (a DiT batch's images end together).",
        "",
        "## Targets",
        "",
        *targets_table(rows),
        "",
        "## Points",
        "",
        *points_table(rows),
        "",
        "## Batching over the window",
        "",
        "From the engines' Prometheus histograms: steps run, mean decode streams (AR) or images (DiT) per step, mean "
        "wall time of a step, and the share of the window spent inside steps (on one GPU the two overlap: a step's "
        "wall time includes waiting for the other process's kernels). DiT windows: new batches that waited for more "
        "renders (`batch_window_s`), and their mean wait. Largest batch: since the services started.",
        "",
        *batching_table(rows),
        "",
        "## Stage breakdown (means per request inside the window, ms; the services' own timings)",
        "",
        *stages_table(rows),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.saturation_report", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="saturation.json files (bench.saturation)")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown file (default: {MARKDOWN_NAME} beside the first)")
    args = parser.parse_args(argv)
    results = [json.loads(path.read_text()) for path in args.results]
    out = args.out or args.results[0].parent / MARKDOWN_NAME
    out.write_text(render(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
