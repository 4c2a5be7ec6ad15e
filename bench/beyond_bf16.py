"""The dashboard's section on what lies past the bf16 limit: the FP8 targets and throughput at saturation.

Each target comes from the benchmark that measures it, each marked pass or FAIL, or "not measured" until a file
has it:

- the AR's FP8 time per token at concurrency 1: the FP8 services run below (its own stage timings), or without one
  the decode step at one row of ``bench.fp8_check``;
- the DiT's FP8 denoise speed-up at 1024x1024: ``bench.fp8_check`` JSONs (``--parts ar`` and ``--parts dit`` may be
  separate files);
- the end-to-end latency at concurrency 1 with FP8: a harness run whose model services ran with
  ``--quantization fp8`` (``bench.harness --extra-ar=--quantization=fp8 --extra-dit=--quantization=fp8``);
- throughput at saturation, bf16 and FP8: ``bench.saturation`` JSONs (``bench.saturation_report`` renders them).

``python -m bench.dashboard RAW.json --fp8 AR.json DIT.json --fp8-run FP8RAW.json --saturation SAT.json ...`` adds
it to DASHBOARD.md.
"""

from __future__ import annotations

from bench import saturation_report
from bench.fp8_check import AR_MS_PER_TOKEN_TARGET, DIT_SPEEDUP_TARGET
from bench.markdown import find_run, fmt, lookup, table

#: End-to-end mean latency at concurrency 1 with FP8 model services: (size, steps) -> seconds.
FP8_C1_LATENCY_LIMITS_S = {(1024, 50): 12.0, (512, 20): 2.8}
NOT_MEASURED = saturation_report.NOT_MEASURED


def _merged_checks(checks: list[dict]) -> dict:
    """One fp8_check report from several (an AR-only and a DiT-only run): a later file's part wins."""
    merged: dict = {}
    for check in checks:
        merged.update({k: v for k, v in check.items() if v is not None})
    return merged


def _row(label: str, value: float | None, text: str | None, ok: bool) -> list[str]:
    if value is None:
        return [label, NOT_MEASURED, NOT_MEASURED]
    return [label, text or fmt(value), "pass" if ok else "FAIL"]


def _served_ms_per_token(fp8_run: dict | None) -> dict[str, float]:
    """"SIZE/STEPS" -> the AR's ms per decode token in the FP8 services run at concurrency 1 (its own timings)."""
    served = {}
    for size, steps in FP8_C1_LATENCY_LIMITS_S:
        run = find_run(fp8_run or {}, size, steps, 1)
        ms = (run or {}).get("stages_ms", {}).get("ar_ms_per_token")
        if ms is not None:
            served[f"{size}/{steps}"] = ms
    return served


def fp8_rows(checks: list[dict], fp8_run: dict | None) -> list[list[str]]:
    """[target, measured, verdict] for the FP8 targets. The AR's time per token at concurrency 1 is the FP8
    services run's (the slowest of its sizes) when it has one, else ``bench.fp8_check``'s decode step at one row."""
    check = _merged_checks(checks)
    rows = []
    label = f"AR ms/token at c1, FP8 <= {AR_MS_PER_TOKEN_TARGET} ms"
    served = _served_ms_per_token(fp8_run)
    if served:
        worst = max(served.values())
        rows.append(_row(label, worst, f"{worst:.2f} ms in the FP8 services ("
                         + ", ".join(f"{point}: {ms:.2f}" for point, ms in served.items()) + ")",
                         worst <= AR_MS_PER_TOKEN_TARGET))
    else:
        positions = lookup(check, "ar_decode", "positions") or []
        first = str(positions[0]) if positions else None
        fp8_ms = lookup(check, "ar_decode", "fp8", "ms_per_token", first) if first else None
        bf16_ms = lookup(check, "ar_decode", "bf16", "ms_per_token", first) if first else None
        rows.append(_row(label, fp8_ms,
                         fp8_ms and f"{fp8_ms:.2f} ms, decode step at 1 row @ {first} positions (bf16 {fmt(bf16_ms, 2)} ms)",
                         fp8_ms is not None and fp8_ms <= AR_MS_PER_TOKEN_TARGET))
    bf16_step, fp8_step = lookup(check, "dit_step", "bf16", "ms", "1024"), lookup(check, "dit_step", "fp8", "ms", "1024")
    speedup = bf16_step / fp8_step if bf16_step and fp8_step else None
    rows.append(_row(f"DiT 1024x1024 guided denoise step, FP8 >= {DIT_SPEEDUP_TARGET}x faster than bf16", speedup,
                     speedup and f"{speedup:.2f}x ({fp8_step:.1f} against {bf16_step:.1f} ms)",
                     speedup is not None and speedup >= DIT_SPEEDUP_TARGET))
    for (size, steps), limit in FP8_C1_LATENCY_LIMITS_S.items():
        run = find_run(fp8_run or {}, size, steps, 1)
        mean = run["latency_s"]["mean"] if run else None
        rows.append(_row(f"{size}x{size}/{steps} c1 mean latency, FP8 <= {limit:g} s", mean,
                         mean and f"{mean:.2f} s", mean is not None and mean <= limit))
    return rows


def section(checks: list[dict], fp8_run: dict | None, saturations: list[dict]) -> list[str]:
    """The markdown lines of the section."""
    lines = ["## Past the bf16 limit: FP8 and saturation", ""]
    sources = [f"FP8 checks: {', '.join(sorted({str(c.get('device', '?')) for c in checks}))}" if checks else
               "FP8 checks: none given (`--fp8`)",
               f"FP8 services run: `{fp8_run.get('command')}`" if fp8_run else
               "FP8 services run: none given (`--fp8-run`), so the FP8 c1 latencies are not measured",
               f"saturation runs: {len(saturations)}" if saturations else "saturation runs: none given (`--saturation`)"]
    lines += [f"- {s}" for s in sources] + [""]
    rows = saturation_report.collect(saturations)
    lines += table(["target", "measured", "verdict"], fp8_rows(checks, fp8_run) + saturation_report.target_rows(rows))
    lines += ["", "Saturation points (closed loops through the gateway; every configuration measured):", ""]
    lines += saturation_report.points_table(rows)
    lines += [""]
    return lines
