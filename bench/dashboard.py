"""The dashboard of one harness run: ``DASHBOARD.md`` (tables and targets) and ``dashboard.png`` (curves).

``python -m bench.dashboard RAW.json [--out DIR] [--bounds BOUNDS.json] [--fp8 FP8.json ...] [--fp8-run FP8RAW.json]
[--saturation SAT.json ...]`` (DIR defaults to the JSON's directory);
``bench.harness`` calls it at the end of a run. ``--bounds`` sets the run's stage figures against bounds measured
later by ``python -m bench.bounds --out BOUNDS.json`` on the same kind of card, instead of those measured in the
run (the timings are the run's either way; the dashboard says which bounds it used). ``--fp8``, ``--fp8-run`` and
``--saturation`` add the FP8 and saturation targets (``bench.beyond_bf16``).

The PNG needs matplotlib (the ``bench`` extra: ``pip install -e '.[bench]'``); without it the markdown is written
alone and says so, and the PNG can be made later from the same JSON on another machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import ratios
from bench.markdown import find_run, fmt, table, verdict

MARKDOWN_NAME = "DASHBOARD.md"
PNG_NAME = "dashboard.png"

# The targets of the performance work; each row: (label, measured value, threshold text, pass?).
AR_BOUND_RATIO = 1.3
DIT_MATMUL_FRACTION = 0.6
TRANSPORT_OVERHEAD_512 = 0.02
C1_LATENCY_LIMITS_S = {(1024, 50): 25.0, (512, 20): 6.0}
C4_SCALING_512 = 3.5


def bounds_section(raw: dict) -> dict | None:
    """The run's bounds section with each size's ratios derived afresh (``bench.ratios``) from its stage figures
    and the bounds it holds, so that runs recorded before a ratio existed show it too."""
    bounds = raw.get("bounds")
    if not bounds or "measured" not in bounds or "decode_weight_bytes" not in bounds:
        return bounds
    rows = [ratios.set_ratios(dict(row), bounds["decode_weight_bytes"], bounds["measured"])
            for row in bounds.get("per_size", [])]
    return {**bounds, "per_size": rows}


def _bound_values(bounds: dict | None) -> tuple[float | None, float | None, dict | None]:
    """(copy GB/s, matmul TFLOP/s, datasheet peaks) of the bounds the ratios are taken against."""
    measured = (bounds or {}).get("measured")
    if not isinstance(measured, dict):
        return None, None, None
    return measured["copy"]["gb_per_s"], measured["matmul"]["tflop_per_s"], ratios.card_peaks(measured)


def targets(raw: dict) -> list[list]:
    """[target, measured, verdict] rows; the bound rows say what they are taken against."""
    rows = []
    bounds = bounds_section(raw)
    gb_per_s, tflops, peaks = _bound_values(bounds)
    for row in (bounds or {}).get("per_size", []):
        label = f"{row['size']}/{row['steps']}"
        ratio = row.get("service_ar_ratio_to_bound")
        text = None
        if ratio is not None:
            text = f"{ratio:.2f}x ({row['service_ar_ms_per_token']:.3f} vs {row['ar_bound_ms_per_token']:.3f} ms"
            if gb_per_s is not None:
                text += f": its weights read at the measured {gb_per_s:,.0f} GB/s"
            if peaks and row.get("ar_bound_ms_per_token_at_datasheet"):
                text += (f"; {row['ar_bound_ms_per_token_at_datasheet']:.3f} ms at the datasheet's "
                         f"{peaks['memory_gb_per_s']:,.0f} GB/s")
            text += ")"
        rows.append([f"AR ms/token within {AR_BOUND_RATIO}x of bound ({label}, c1)", text,
                     verdict(ratio, ratio is not None and ratio <= AR_BOUND_RATIO)])
        fraction = row.get("service_dit_fraction_of_matmul")
        text = None
        if fraction is not None:
            text = f"{fraction:.1%}" + (f" of the measured {tflops:.1f} TFLOP/s" if tflops is not None else "")
            text += f" ({row['service_dit_tflop_per_s']:.1f} TFLOP/s"
            if row.get("service_dit_fraction_of_datasheet") is not None:
                text += (f"; {row['service_dit_fraction_of_datasheet']:.1%} of the datasheet's "
                         f"{peaks['bf16_dense_tflop_per_s']:g}" if peaks else "")
            text += ")"
        rows.append([f"DiT >= {DIT_MATMUL_FRACTION:.0%} of measured matmul rate ({label}, c1)", text,
                     verdict(fraction, fraction is not None and fraction >= DIT_MATMUL_FRACTION)])
    if not (bounds or {}).get("per_size"):
        rows.append([f"AR ms/token within {AR_BOUND_RATIO}x of bound", None, verdict(None, False)])
        rows.append([f"DiT >= {DIT_MATMUL_FRACTION:.0%} of measured matmul rate", None, verdict(None, False)])
    overhead = [r for r in raw.get("transport_overhead", []) if r["size"] == 512]
    value = overhead[0]["overhead"] if overhead else None
    rows.append([f"transport overhead <= {TRANSPORT_OVERHEAD_512:.0%} at 512 (c1, via {raw.get('via', 'rest')})",
                 None if value is None else f"{value:.2%}", verdict(value, value is not None and value <= TRANSPORT_OVERHEAD_512)])
    for (size, steps), limit in C1_LATENCY_LIMITS_S.items():
        run = find_run(raw, size, steps, 1)
        mean = run["latency_s"]["mean"] if run else None
        rows.append([f"{size}/{steps} steps c1 mean latency <= {limit:g} s",
                     None if mean is None else f"{mean:.2f} s", verdict(mean, mean is not None and mean <= limit)])
    c1, c4 = find_run(raw, 512, 20, 1), find_run(raw, 512, 20, 4)
    scaling, key = None, None
    if c1 and c4:  # the steady throughput where both points have one (runs from before it was recorded do not)
        key = next((k for k in ("steady_throughput_images_per_s", "throughput_images_per_s")
                    if c1.get(k) and c4.get(k)), None)
        scaling = c4[key] / c1[key] if key else None
    how = " (steady)" if key == "steady_throughput_images_per_s" else ""
    rows.append([f"c4 throughput >= {C4_SCALING_512}x c1 at 512/20{how}",
                 None if scaling is None else f"{scaling:.2f}x",
                 verdict(scaling, scaling is not None and scaling >= C4_SCALING_512)])
    return rows


def _peaks(peaks: dict | None) -> str:
    if not peaks:
        return "not measured (no nvidia-smi)"
    return ", ".join(f"{name} {fmt(value)}" for name, value in peaks.items())


def markdown(raw: dict, png_note: str, image: str | None = None, extra: list[str] | None = None) -> str:
    """The page; ``extra``: lines of a further section after the targets (``bench.beyond_bf16``)."""
    machine = raw.get("machine", {})
    what = machine.get("gpu") or f"{machine.get('cpus')} CPUs"
    lines = [
        f"# Benchmark: {raw.get('model')} on {what}",
        "",
        f"- machine: {machine.get('hostname')} ({what}; {machine.get('platform')}; torch {machine.get('torch')})",
        f"- command: `{raw.get('command')}`",
        f"- date: {raw.get('date')}",
        f"- model: {raw.get('model')}, {raw.get('dtype')}, requests via {raw.get('via')}; prompt \"{raw.get('prompt')}\"",
        f"- services started in {fmt(raw.get('startup_s'), 1)} s; closed-loop clients, client i starting "
        "i * (c1 mean latency / c) after client 0",
        f"- peak GPU memory over the run (MiB, nvidia-smi): {_peaks(raw.get('peak_gpu_mib'))}",
        f"- plot: {png_note}",
        "",
        *([f"![latency and throughput against concurrency]({image})", ""] if image else []),
        "## Targets",
        "",
        *table(["target", "measured", "verdict"], targets(raw)),
        "",
        *against(bounds_section(raw)),
        *(extra or []),
        "## Sweep",
        "",
        "Latency is the client's (seconds); throughput = completed images / (last end - first start); steady = "
        "images completed while all c clients were active (from the start of the c-th request to the start of the "
        "last one) / that window, which leaves out the ramp and the drain of a short point.",
        "",
    ]
    rows = []
    for point in raw.get("points", []):
        for run in point["runs"]:
            lat = run.get("latency_s") or {}
            peaks = run.get("peak_gpu_mib") or {}
            engines = run.get("engines") or {}
            counts = run.get("engine_counts") or {}
            rows.append([
                f"{point['size']}/{point['steps']}", run["concurrency"], f"{run['completed']}/{run['requests']}",
                lat.get("mean"), lat.get("p50"), lat.get("p95"), lat.get("p99"), run.get("throughput_images_per_s"),
                run.get("steady_throughput_images_per_s"),
                (engines.get("ar") or {}).get("largest_batch"), (counts.get("ar") or {}).get("batched_steps_total"),
                (engines.get("dit") or {}).get("largest_batch"), (counts.get("dit") or {}).get("batched_steps_total"),
                peaks.get("ar_service"), peaks.get("dit_service"),
            ])
    lines += table(["size/steps", "c", "done", "mean s", "p50 s", "p95 s", "p99 s", "images/s", "steady images/s",
                     "AR largest batch", "AR batched steps", "DiT largest batch", "DiT batched steps", "AR peak MiB", "DiT peak MiB"], rows)
    lines += ["", "Largest batch: since the services started (GetStatus after the point); batched steps: decode tokens "
              "(AR) and denoise steps (DiT) run with more than one request in the batch during the point. Peak MiB: "
              "nvidia-smi, per service process, during the point."]
    lines += ["", "## Stage breakdown (means per request, ms; the services' own timings)", ""]
    keys = ["ar_prefill_ms", "ar_decode_ms", "ar_tokens", "ar_ms_per_token", "condition_transfer_ms", "dit_queue_ms",
            "denoise_ms", "vae_decode_ms", "encode_ms", "gateway_ms", "total_ms", "client_unaccounted_ms"]
    rows = []
    for point in raw.get("points", []):
        for run in point["runs"]:
            stages = run.get("stages_ms") or {}
            rows.append([f"{point['size']}/{point['steps']}", run["concurrency"], *(stages.get(k) for k in keys)])
    for point in (raw.get("inprocess") or {}).get("points", []):
        stages = point["stages_mean"]
        rows.append([f"{point['size']}/{point['steps']}", "in-process", *(stages.get(k) for k in keys)])
    lines += table(["size/steps", "c", "AR prefill", "AR decode", "AR tokens", "AR ms/token", "cond. transfer",
                     "DiT queue", "denoise", "VAE decode", "encode", "gateway", "service total", "client unaccounted"],
                    rows)
    lines += ["", "In process: condition transfer = the hand-over to the DiT inside one process (device copy, refiner); "
              "no queue, no gateway. Client unaccounted = client latency - service total - gateway time.", ""]
    device_times = [(p, p["stages_mean"]) for p in (raw.get("inprocess") or {}).get("points", [])
                    if p["stages_mean"].get("ar_device_ms_per_token") is not None]
    if device_times:
        lines += ["In process, AR decode per token on the GPU (CUDA events around each step's upload and graph replay) "
                  "against its wall time: " + "; ".join(
                      f"{p['size']}/{p['steps']}: {fmt(m['ar_device_ms_per_token'], 3)} of {fmt(m['ar_ms_per_token'], 3)} ms"
                      for p, m in device_times) + ".", ""]
    lines += ["## Transport overhead (c1 mean vs the same pipeline in one process)", ""]
    ip = raw.get("inprocess")
    if ip:
        lines += [f"In process: {ip.get('requests_per_point')} request(s) per size on {ip.get('device')}, AR decoder "
                  f"{ip.get('decoder', 'eager')}, models built in {fmt(ip.get('load_s'), 1)} s"
                  + (f", peak GPU memory {ip['peak_gpu_mib']} MiB" if ip.get("peak_gpu_mib") else "") + ".", ""]
    lines += table(["size/steps", "via", "service c1 mean s", "in-process mean s", "overhead"],
                    [[f"{r['size']}/{r['steps']}", r.get("via"), r.get("service_c1_mean_s"), r.get("inprocess_mean_s"),
                      f"{r['overhead']:.2%}"] for r in raw.get("transport_overhead", [])] or [["-", "-", "-", "-", "-"]])
    lines += ["", "## Physical bounds", ""]
    bounds = bounds_section(raw)
    if bounds and "measured" in bounds:
        lines += bound_lines(bounds)
        lines += [f"- AR decode weight bytes per token: {bounds['decode_weight_bytes'] / 1e9:.3f} GB "
                  f"({bounds['dtype_bytes']} bytes per value)", ""]
        rows = []
        for row in bounds["per_size"]:
            flops = row["dit_flops"]
            rows.append([
                f"{row['size']}/{row['steps']}", row["ar_bound_ms_per_token"], row.get("service_ar_ms_per_token"),
                row.get("service_ar_ratio_to_bound"), row.get("inprocess_ar_ms_per_token"),
                row.get("inprocess_ar_ratio_to_bound"), flops["flops"] / 1e12,
                f"{flops['condition_tokens']}+{flops['image_tokens']}", flops["transformer_calls"],
                row.get("service_dit_tflop_per_s"), row.get("service_dit_fraction_of_matmul"),
                row.get("service_dit_fraction_of_datasheet"),
                row.get("inprocess_dit_tflop_per_s"), row.get("inprocess_dit_fraction_of_matmul"),
            ])
        lines += table(["size/steps", "AR bound ms/tok", "service ms/tok", "x bound", "in-proc ms/tok", "x bound",
                         "denoise TFLOP", "cond+image tokens", "calls", "service TFLOP/s", "of measured matmul",
                         "of datasheet", "in-proc TFLOP/s", "of measured matmul"], rows)
        lines += ["", "AR bound = decode weight bytes / the measured copy bandwidth. \"Of measured matmul\": the DiT's "
                  "TFLOP/s over the measured matmul rate; \"of datasheet\": over the card's datasheet peak (dense "
                  "bf16). DiT FLOPs: linear layers 2 x params x tokens, attention 4 x L^2 x head_dim x heads per layer, "
                  "conditional branch every step plus the unconditional one (image tokens only) on guided steps.", ""]
    else:
        lines += ["Not measured in this run.", ""]
    return "\n".join(lines) + "\n"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def _shape(shape: list[int]) -> str:
    return f"{shape[0]}^3" if len(set(shape)) == 1 else "x".join(map(str, shape))


def how_measured(measured: dict) -> str:
    """How a bounds measurement was made, in a few words."""
    method = measured.get("method")
    if not method:  # bench.bounds before it warmed up until steady (before 2026-12-03)
        return (f"one size each, the best of {measured['matmul'].get('repeats')} single runs after at most 0.3 s of "
                "warm-up")
    sizes = measured["matmul"].get("sizes", []) + measured["copy"].get("sizes", [])
    unsteady = sum(not size.get("stable", True) for size in sizes)
    return (f"the best of several sizes, each warmed up for at least {method['min_warm_s']:g} s and until "
            f"{method['agree']} windows of {method['window_s']:g} s agreed within {method['tolerance']:.1%}, then the best "
            f"of {method['windows']} timed windows" + (f"; {unsteady} of {len(sizes)} sizes never steady" if unsteady else ""))


def _figures(measured: dict) -> str:
    return (f"copy bandwidth {measured['copy']['gb_per_s']:,.0f} GB/s and {measured['matmul']['dtype']} matmul rate "
            f"{measured['matmul']['tflop_per_s']:.1f} TFLOP/s")


def against(bounds: dict | None) -> list[str]:
    """The paragraph under the targets: which bounds the ratios are taken against, how and when they were
    measured, and the card's datasheet peaks."""
    measured = (bounds or {}).get("measured")
    if not isinstance(measured, dict):
        return []
    if bounds and bounds.get("restated_from"):
        own = bounds.get("measured_in_run")
        when = (f"measured on {measured.get('date') or 'a later date'} by `{measured.get('command') or 'python -m bench.bounds'}` "
                f"({bounds['restated_from']}) on {measured.get('device_name') or measured.get('device')}, not in "
                "this run: the timings are this run's, the bounds a later measurement"
                + (f". This run's own measurement ({how_measured(own)}): {_figures(own)}" if own else ""))
    else:
        when = "measured in this run, on the idle device, before the services started"
    text = f"Ratios to bounds are taken against the measured {_figures(measured)} ({how_measured(measured)}), {when}."
    peaks = ratios.card_peaks(measured)
    if peaks:
        text += (f" The card's datasheet peaks ({peaks['source']}): {peaks['memory_gb_per_s']:,.0f} GB/s memory "
                 f"bandwidth, {peaks['bf16_dense_tflop_per_s']:g} TFLOP/s dense bf16; the measured bounds are "
                 f"{measured['copy']['gb_per_s'] / peaks['memory_gb_per_s']:.1%} and "
                 f"{measured['matmul']['tflop_per_s'] / peaks['bf16_dense_tflop_per_s']:.1%} of them.")
    else:
        text += " No datasheet figure is known for this device."
    return [text, ""]


def _smi(state: dict | None) -> str | None:
    if not state:
        return None
    parts = []
    if state.get("clocks.sm") is not None:
        parts.append(f"SM {state['clocks.sm']:g}" + (f" of {state['clocks.max.sm']:g}" if state.get("clocks.max.sm") else "")
                     + " MHz")
    if state.get("clocks.mem") is not None:
        parts.append(f"memory {state['clocks.mem']:g} MHz")
    if state.get("power.draw") is not None:
        parts.append(f"{state['power.draw']:g} W" + (f" of {state['power.limit']:g}" if state.get("power.limit") else ""))
    if state.get("temperature.gpu") is not None:
        parts.append(f"{state['temperature.gpu']:g} C")
    if state.get("pstate"):
        parts.append(str(state["pstate"]))
    return ", ".join(parts) or None


def bound_lines(bounds: dict) -> list[str]:
    """The bounds as list items: each figure, its sizes and warm-up, the datasheet's, nvidia-smi's clocks."""
    measured = bounds["measured"]
    copy, matmul = measured["copy"], measured["matmul"]
    lines = [f"- device: {measured.get('device_name') or measured['device']}"]
    if "sizes" not in copy:  # one size, from before bench.bounds tried several
        lines += [f"- copy bandwidth: {copy['gb_per_s']:.1f} GB/s (read + write of {copy['bytes'] / 2**30:.2f} GiB "
                  f"bf16, best of {copy.get('repeats')} single copies after at most 0.3 s of warm-up)",
                  f"- matmul rate: {matmul['tflop_per_s']:.1f} TFLOP/s ({matmul['dtype']} {matmul.get('n')}^3, best of "
                  f"{matmul.get('repeats')} single products after at most 0.3 s of warm-up)"]
    else:
        per_copy = "; ".join(f"{_size(s['bytes'])}: {s['gb_per_s']:,.0f}" for s in copy["sizes"])
        per_matmul = "; ".join(f"{_shape(s['shape'])}: {s['tflop_per_s']:.1f}" for s in matmul["sizes"])
        warm = [s["warm_s"] for s in copy["sizes"] + matmul["sizes"]]
        lines += [f"- copy bandwidth: {copy['gb_per_s']:,.1f} GB/s, counted as bytes read + bytes written (2 x the "
                  f"tensor per copy); the best size's, of {per_copy} GB/s",
                  f"- matmul rate: {matmul['tflop_per_s']:.1f} TFLOP/s ({matmul['dtype']}, random data, 2 m k n FLOPs); "
                  f"the best shape's, of {per_matmul} TFLOP/s",
                  f"- method: {how_measured(measured)}; warm-up took {min(warm):.1f}-{max(warm):.1f} s per size"]
    peaks = ratios.card_peaks(measured)
    if peaks:
        lines.append(f"- datasheet ({peaks['source']}): {peaks['memory_gb_per_s']:,.0f} GB/s, "
                     f"{peaks['bf16_dense_tflop_per_s']:g} TFLOP/s dense bf16; measured "
                     f"{copy['gb_per_s'] / peaks['memory_gb_per_s']:.1%} and "
                     f"{matmul['tflop_per_s'] / peaks['bf16_dense_tflop_per_s']:.1%} of them")
    else:
        lines.append("- datasheet: no figure known for this device")
    readings = [(label, _smi(state)) for label, state in (
        ("idle", measured.get("gpu_idle")),
        ("under the best matmul", next((s.get("gpu_under_load") for s in matmul.get("sizes", [])
                                        if s.get("shape") == matmul.get("shape")), None)),
        ("under the best copy", next((s.get("gpu_under_load") for s in copy.get("sizes", [])
                                      if s.get("bytes") == copy.get("bytes")), None)))]
    if any(text for _, text in readings):
        lines.append("- nvidia-smi: " + "; ".join(f"{label}: {text}" for label, text in readings if text))
    if bounds.get("restated_from") and bounds.get("measured_in_run"):
        lines.append(f"- measured in this run, not used above: {_figures(bounds['measured_in_run'])} "
                     f"({how_measured(bounds['measured_in_run'])})")
    return lines


def plot(raw: dict, path: Path) -> bool:
    """Latency (mean and p95) and throughput against concurrency, one line per size; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for point in raw.get("points", []):
        runs = [r for r in point["runs"] if r.get("latency_s")]
        if not runs:
            continue
        label = f"{point['size']}px/{point['steps']} steps"
        c = [r["concurrency"] for r in runs]
        line = left.plot(c, [r["latency_s"]["mean"] for r in runs], marker="o", label=f"{label} mean")[0]
        left.plot(c, [r["latency_s"]["p95"] for r in runs], marker="x", linestyle="--", color=line.get_color(),
                  label=f"{label} p95")
        right.plot(c, [r["throughput_images_per_s"] for r in runs], marker="o", color=line.get_color(), label=label)
    levels = sorted({r["concurrency"] for point in raw.get("points", []) for r in point["runs"]})
    for axis, ylabel in ((left, "latency (s)"), (right, "throughput (images/s)")):
        axis.set_xlabel("concurrency (closed-loop clients)")
        axis.set_ylabel(ylabel)
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    machine = raw.get("machine", {})
    fig.suptitle(f"{raw.get('model')} on {machine.get('gpu') or machine.get('device')}, via {raw.get('via')} "
                 f"({raw.get('date')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(raw: dict, out: Path, extra: list[str] | None = None) -> list[Path]:
    """Writes the PNG (when matplotlib is there) and DASHBOARD.md into ``out``; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / PNG_NAME
    made = plot(raw, png)
    note = f"[{PNG_NAME}]({PNG_NAME})" if made else (
        "skipped: matplotlib is not installed here (`pip install -e '.[bench]'`, then "
        "`python -m bench.dashboard raw.json`)")
    if not made:
        print(f"[dashboard] matplotlib missing: {PNG_NAME} skipped", file=sys.stderr)
    md = out / MARKDOWN_NAME
    md.write_text(markdown(raw, note, PNG_NAME if made else None, extra))
    return [md, png] if made else [md]


def merge(runs: list[dict]) -> dict:
    """One raw report from several harness runs on one machine (e.g. one per size, each within a time limit):
    their points, in-process points, transport rows and bound rows side by side; the physical bounds measured
    by the first run that has them; every command and date listed."""
    if len(runs) == 1:
        return runs[0]
    machines = {json.dumps(run.get("machine"), sort_keys=True) for run in runs}
    if len(machines) > 1:
        raise ValueError("these reports come from different machines; merge runs of one machine only")
    merged = dict(runs[0])
    merged["command"] = " ; ".join(str(run.get("command")) for run in runs)
    merged["date"] = " ; ".join(str(run.get("date")) for run in runs)
    merged["points"] = [point for run in runs for point in run.get("points", [])]
    merged["transport_overhead"] = [row for run in runs for row in run.get("transport_overhead", [])]
    inprocess = [run["inprocess"] for run in runs if run.get("inprocess")]
    if inprocess:
        merged["inprocess"] = {**inprocess[0], "points": [p for ip in inprocess for p in ip.get("points", [])]}
    with_bounds = [run["bounds"] for run in runs if run.get("bounds")]
    if with_bounds:
        merged["bounds"] = {**with_bounds[0], "per_size": [row for b in with_bounds for row in b.get("per_size", [])]}
    peaks: dict = {}
    for run in runs:
        for name, mib in (run.get("peak_gpu_mib") or {}).items():
            if mib is not None:
                peaks[name] = max(mib, peaks.get(name) or 0)
    merged["peak_gpu_mib"] = peaks or None
    return merged


def read_bounds(path: Path, raw: dict) -> dict:
    """A bounds file written by ``python -m bench.bounds --out``, checked to be one, and to come from the kind of
    card the run used."""
    try:
        measured = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    wanted = (("copy", "gb_per_s"), ("matmul", "tflop_per_s"))
    if not isinstance(measured, dict) or not all(
            isinstance(measured.get(kind), dict) and isinstance(measured[kind].get(key), int | float) for kind, key in wanted):
        raise ValueError(f"{path} is not a bounds file: it has no copy.gb_per_s and matmul.tflop_per_s "
                         "(`python -m bench.bounds --out FILE` writes one)")
    card, run_card = measured.get("device_name"), (raw.get("machine") or {}).get("gpu")
    if card != run_card:
        raise ValueError(f"{path} was measured on {card or measured.get('device')}, the run on {run_card or 'a CPU'}: "
                         "re-state a run only against bounds of the same kind of device")
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, nargs="+",
                        help="the raw.json a harness run wrote; several runs of one machine are merged into one")
    parser.add_argument("--out", type=Path, default=None, help="directory (default: the first JSON's)")
    parser.add_argument("--bounds", type=Path, default=None,
                        help="a JSON from `python -m bench.bounds --out FILE`: set the run's stage figures against "
                             "these bounds instead of those measured in the run")
    parser.add_argument("--fp8", type=Path, nargs="+", default=[],
                        help="bench.fp8_check JSONs (AR and DiT parts): the FP8 step targets")
    parser.add_argument("--fp8-run", type=Path, default=None,
                        help="a harness raw.json whose model services ran with --quantization fp8: the FP8 c1 latencies")
    parser.add_argument("--saturation", type=Path, nargs="+", default=[],
                        help="bench.saturation JSONs: the throughput targets and points")
    args = parser.parse_args(argv)
    raw = merge([json.loads(path.read_text()) for path in args.raw])
    extra = None
    if args.fp8 or args.fp8_run or args.saturation:
        from bench import beyond_bf16  # through bench.fp8_check it imports torch: only when its section is asked for

        extra = beyond_bf16.section([json.loads(p.read_text()) for p in args.fp8],
                                    json.loads(args.fp8_run.read_text()) if args.fp8_run else None,
                                    [json.loads(p.read_text()) for p in args.saturation])
    if args.bounds is not None:
        try:
            raw = {**raw, "bounds": ratios.restate(raw.get("bounds") or {}, read_bounds(args.bounds, raw), args.bounds.name)}
        except ValueError as exc:
            parser.error(str(exc))
    out = args.out or args.raw[0].parent
    if len(args.raw) > 1:  # the merged report beside the dashboard made from it (inputs left as they are)
        out.mkdir(parents=True, exist_ok=True)
        (out / "merged.json").write_text(json.dumps(raw, indent=2) + "\n")
    for path in write(raw, out, extra):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
