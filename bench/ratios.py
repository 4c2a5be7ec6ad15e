"""The stages' speed as a share of the machine's bounds: the one place these ratios are computed.

The harness records each size's stage figures (the AR's ms per decode token, the DiT's achieved TFLOP/s) and
sets them against the bounds it measured (``set_ratios``). The stage figures are timings and never change; the
bounds can be measured again, better, on the same kind of card, and ``restate`` sets a finished run's figures
against them (``python -m bench.dashboard RAW --bounds BOUNDS.json``). Standard library only, so the dashboard
can re-state a run where torch is not installed.
"""

from __future__ import annotations

import copy

from bench import datasheet

STAGE_SOURCES = ("service", "inprocess")  # the services at c1, and the same pipeline in one process


def ar_bound_ms_per_token(weight_bytes: float, gb_per_s: float) -> float:
    """The least time one AR decode token can take: its weights read once at ``gb_per_s``."""
    return weight_bytes / (gb_per_s * 1e9) * 1e3


def dit_tflop_per_s(flops: float, denoise_ms: float) -> float | None:
    return flops / (denoise_ms / 1e3) / 1e12 if denoise_ms > 0 else None


def card_peaks(measured: dict) -> dict | None:
    """The datasheet peaks recorded with the measurement, or looked up by its device name (measurements from
    before they were recorded)."""
    return measured.get("datasheet") or datasheet.peaks(measured.get("device_name"))


def set_ratios(row: dict, weight_bytes: float, measured: dict) -> dict:
    """Fills one size's row (``{source}_ar_ms_per_token`` and ``{source}_dit_tflop_per_s`` already in it) with
    the AR bound and each source's ratio to the measured bounds, and the same against the datasheet where the
    card is known. Returns ``row``."""
    gb_per_s, tflops = measured["copy"]["gb_per_s"], measured["matmul"]["tflop_per_s"]
    peaks = card_peaks(measured)
    row["ar_bound_ms_per_token"] = ar_bound_ms_per_token(weight_bytes, gb_per_s)
    row["ar_bound_ms_per_token_at_datasheet"] = (
        ar_bound_ms_per_token(weight_bytes, peaks["memory_gb_per_s"]) if peaks else None)
    for source in STAGE_SOURCES:
        if f"{source}_ar_ms_per_token" in row:
            row[f"{source}_ar_ratio_to_bound"] = row[f"{source}_ar_ms_per_token"] / row["ar_bound_ms_per_token"]
        if f"{source}_dit_tflop_per_s" in row:
            achieved = row[f"{source}_dit_tflop_per_s"]
            row[f"{source}_dit_fraction_of_matmul"] = None if achieved is None else achieved / tflops
            row[f"{source}_dit_fraction_of_datasheet"] = (
                achieved / peaks["bf16_dense_tflop_per_s"] if achieved is not None and peaks else None)
    return row


def restate(bounds: dict, measured: dict, source: str) -> dict:
    """A run's ``bounds`` section set against ``measured`` (what ``python -m bench.bounds`` wrote, read from
    ``source``) instead of the bounds measured in the run, which stay under ``measured_in_run``. The stage
    figures are kept as they were."""
    if not bounds or not bounds.get("per_size"):
        raise ValueError("this run has no bounds rows to re-state (it ran with --no-bounds, or stopped before them)")
    restated = copy.deepcopy(bounds)
    restated["measured_in_run"] = bounds.get("measured_in_run") or bounds.get("measured")
    restated["measured"] = measured
    restated["restated_from"] = source
    for row in restated["per_size"]:
        set_ratios(row, bounds["decode_weight_bytes"], measured)
    return restated
