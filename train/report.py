"""The training log: command, seed, data sizes, steps and losses as JSON, and the loss curves as a PNG.

The plot is drawn with PIL (always present here), one panel per stage, log-scaled loss against step.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw

LOG_NAME = "training_log.json"
PLOT_NAME = "loss_curves.png"


def read_log(directory: Path) -> dict:
    path = Path(directory) / LOG_NAME
    return json.loads(path.read_text()) if path.is_file() else {"runs": []}


def append_run(directory: Path, run: dict) -> Path:
    """Adds one command's record (its stages, checks and environment) to the log and redraws the plot."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    log = read_log(directory)
    run = {"command": " ".join(["python -m", *sys.argv]) if sys.argv else "", "python": platform.python_version(),
           "torch": torch.__version__, **run}
    log["runs"].append(run)
    (directory / LOG_NAME).write_text(json.dumps(log, indent=2) + "\n")
    plot(log, directory / PLOT_NAME)
    return directory / LOG_NAME


UNIFORM_LOSS = (30, 70, 220)
WEIGHTED_LOSS = (230, 120, 20)  # a run with --dit-shape-weight: a different loss, so not on the same scale


def stage_segments(log: dict) -> dict[str, list[tuple[bool, int, int, list[list[float]]]]]:
    """Per stage: its latest run, joined to the runs it continued from (``continued``: the run started from the
    checkpoint the earlier runs wrote), as (weighted loss?, first step, steps, [[step, loss], ...]) per run, steps
    counted from the first of them."""
    stages: dict[str, list] = {}
    for run in log["runs"]:
        for stage in run.get("stages", []):
            before = stages.get(stage["stage"], []) if run.get("continued") else []
            offset = before[-1][1] + before[-1][2] if before else 0
            weighted = bool(stage.get("data", {}).get("shape_weight"))
            points = [[offset + s, v] for s, v in stage["losses"]]
            stages[stage["stage"]] = before + [(weighted, offset, stage["steps"], points)]
    return {k: v for k, v in stages.items() if any(run[3] for run in v)}


def plot(log: dict, path: Path) -> None:
    """One panel per stage (``stage_segments``): a grey line where each continued run starts; runs on the
    shape-weighted DiT loss in orange, since their values do not compare with the uniform loss."""
    stages = stage_segments(log)
    if not stages:
        return
    w, h, pad = 360, 240, 36
    image = Image.new("RGB", (w * len(stages), h), "white")
    draw = ImageDraw.Draw(image)
    for i, (name, runs) in enumerate(stages.items()):
        x0 = i * w
        losses = [p for *_, points in runs for p in points]
        values = [math.log10(max(v, 1e-8)) for _, v in losses]
        lo, hi = min(values), max(values)
        hi = hi if hi > lo else lo + 1
        smax = max(runs[-1][1] + runs[-1][2], 1)

        def xy(step: float, loss: float, x0=x0, smax=smax, lo=lo, hi=hi) -> tuple[float, float]:
            v = math.log10(max(loss, 1e-8))
            return x0 + pad + (w - 2 * pad) * step / smax, h - pad - (h - 2 * pad) * (v - lo) / (hi - lo)

        draw.rectangle([x0 + pad, pad, x0 + w - pad, h - pad], outline="gray")
        for k, (weighted, start, _, points) in enumerate(runs):
            if k:
                x = xy(start, 1)[0]
                draw.line([(x, pad), (x, h - pad)], fill=(200, 200, 200), width=1)
            if len(points) > 1:
                draw.line([xy(*p) for p in points], fill=WEIGHTED_LOSS if weighted else UNIFORM_LOSS, width=2)
        draw.text((x0 + pad, 8), f"{name}: loss (log10) vs step", fill="black")
        if any(run[0] for run in runs):
            draw.text((x0 + pad, 20), "orange: shape-weighted loss", fill=WEIGHTED_LOSS)
        draw.text((x0 + 4, pad - 4), f"{10 ** hi:.3g}", fill="black")
        draw.text((x0 + 4, h - pad - 6), f"{10 ** lo:.3g}", fill="black")
        draw.text((x0 + w - pad - 30, h - pad + 6), str(smax), fill="black")
    image.save(path)
