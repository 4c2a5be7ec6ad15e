"""The training log: command, seed, data sizes, steps and losses as JSON, and the loss curves as a PNG.

The plot is drawn with PIL (always present here), one panel per stage, log-scaled loss against step.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from typing import NamedTuple

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
PANEL_W, PANEL_H, PAD = 360, 240, 36


class Segment(NamedTuple):
    """One run of one stage on the joined curve."""

    weighted: bool  # trained on the shape-weighted DiT loss
    start: int  # its first step on the joined curve
    steps: int
    points: list[list[float]]  # [[step on the joined curve, loss], ...]


def stage_segments(log: dict) -> dict[str, list[Segment]]:
    """Per stage: its latest run, joined to the runs it continued from (``continued``: the run started from the
    checkpoint the earlier runs wrote), steps counted from the first of them."""
    stages: dict[str, list[Segment]] = {}
    for run in log["runs"]:
        for stage in run.get("stages", []):
            before = stages.get(stage["stage"], []) if run.get("continued") else []
            start = before[-1].start + before[-1].steps if before else 0
            weighted = bool(stage.get("data", {}).get("shape_weight"))
            points = [[start + s, v] for s, v in stage["losses"]]
            stages[stage["stage"]] = before + [Segment(weighted, start, stage["steps"], points)]
    return {k: v for k, v in stages.items() if any(segment.points for segment in v)}


def _pixel(step: float, loss: float, x0: int, smax: int, lo: float, hi: float) -> tuple[float, float]:
    """Where (step, loss) lands in the panel starting at ``x0``: steps 0..smax across, log10 loss lo..hi up."""
    v = math.log10(max(loss, 1e-8))
    return (x0 + PAD + (PANEL_W - 2 * PAD) * step / smax,
            PANEL_H - PAD - (PANEL_H - 2 * PAD) * (v - lo) / (hi - lo))


def plot(log: dict, path: Path) -> None:
    """One panel per stage (``stage_segments``): a grey line where each continued run starts; runs on the
    shape-weighted DiT loss in orange, since their values do not compare with the uniform loss."""
    stages = stage_segments(log)
    if not stages:
        return
    image = Image.new("RGB", (PANEL_W * len(stages), PANEL_H), "white")
    draw = ImageDraw.Draw(image)
    for i, (name, segments) in enumerate(stages.items()):
        x0 = i * PANEL_W
        values = [math.log10(max(v, 1e-8)) for segment in segments for _, v in segment.points]
        lo, hi = min(values), max(values)
        hi = hi if hi > lo else lo + 1
        smax = max(segments[-1].start + segments[-1].steps, 1)
        draw.rectangle([x0 + PAD, PAD, x0 + PANEL_W - PAD, PANEL_H - PAD], outline="gray")
        for k, segment in enumerate(segments):
            if k:
                x = _pixel(segment.start, 1, x0, smax, lo, hi)[0]
                draw.line([(x, PAD), (x, PANEL_H - PAD)], fill=(200, 200, 200), width=1)
            if len(segment.points) > 1:
                draw.line([_pixel(s, v, x0, smax, lo, hi) for s, v in segment.points],
                          fill=WEIGHTED_LOSS if segment.weighted else UNIFORM_LOSS, width=2)
        draw.text((x0 + PAD, 8), f"{name}: loss (log10) vs step", fill="black")
        if any(segment.weighted for segment in segments):
            draw.text((x0 + PAD, 20), "orange: shape-weighted loss", fill=WEIGHTED_LOSS)
        draw.text((x0 + 4, PAD - 4), f"{10 ** hi:.3g}", fill="black")
        draw.text((x0 + 4, PANEL_H - PAD - 6), f"{10 ** lo:.3g}", fill="black")
        draw.text((x0 + PANEL_W - PAD - 30, PANEL_H - PAD + 6), str(smax), fill="black")
    image.save(path)
