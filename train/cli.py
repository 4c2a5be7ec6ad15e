"""Runs training stages in order on one device and writes the checkpoint (and the log) after each.

A stage starts from the checkpoint at ``--out`` when one is there (so ``vae``, then ``ar``, then ``dit`` can run
as separate commands), else from fresh weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import time
from pathlib import Path

# The services fuse a few elementwise ops with torch.compile on CUDA; training runs them plain (no compile time).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from servicekit.checkpoint import CONFIG_FILE  # noqa: E402
from train import architecture, checkpoint, report, selfcheck, stages  # noqa: E402

STAGES = ("vae", "ar", "dit")
DEFAULT_BUDGET_S = {"vae": 50.0, "ar": 45.0, "dit": 300.0}  # with data, conditions and the check: ~8 min on one H200


def number(text: str) -> float:
    """``text`` as a float, NaN when it is not a number (so one finiteness check refuses both)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def shape_weight(text: str) -> float:
    """``--dit-shape-weight``'s W: a finite number >= 0 (the shape's latents weigh 1 + W)."""
    value = number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (a factor such as a learning-rate scale)."""
    value = number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number; got {text!r}")
    return value


def positive_count(text: str) -> int:
    """A count of examples: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return value


SHAPE_WEIGHT_HELP = "extra DiT loss weight on the latents the (target's) shape touches (0: uniform)"


def parser(description: str, with_stages: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    if with_stages:
        p.add_argument("stages", nargs="+", choices=STAGES, help="stages to run, in the order given")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory (read if present, then replaced)")
    p.add_argument("--log-dir", type=Path, help=f"where {report.LOG_NAME} and {report.PLOT_NAME} go (default: beside --out)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", choices=sorted(stages.SCALES), default="full", help="data and step counts (micro: CPU test)")
    for name in STAGES:
        p.add_argument(f"--budget-{name}", type=float, default=DEFAULT_BUDGET_S[name], help=f"seconds of {name} training at most")
    p.add_argument("--dit-batch", type=positive_count, help="DiT batch size (default: the scale's)")
    p.add_argument("--dit-shape-weight", type=shape_weight, default=0.0, help=SHAPE_WEIGHT_HELP)
    p.add_argument("--dit-lr", type=float, default=stages.DIT_PEAK_LR,
                   help="DiT peak learning rate (lower to fine-tune a trained DiT)")
    p.add_argument("--eval-budget", type=float, default=40.0, help="seconds for the in-process held-out check (0: skip)")
    return p


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start(args: argparse.Namespace, scales: dict):
    """(device, scale) of a training command: TF32 matmuls on CUDA, every generator seeded, the scale chosen with
    ``--dit-batch`` over its DiT batch."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seed_everything(args.seed)
    scale = scales[args.scale]
    if args.dit_batch:
        scale = dataclasses.replace(scale, dit_batch=args.dit_batch)
    return device, scale


def run(args: argparse.Namespace, names: list[str]) -> dict:
    started = time.monotonic()
    device, scale = start(args, stages.SCALES)
    continued = (args.out / CONFIG_FILE).is_file()
    if continued:
        ar, dit, vae = checkpoint.load(args.out, device, args.seed)
        print(f"continuing from {args.out}", flush=True)
    else:
        ar = architecture.new_ar(device, args.seed)
        dit, vae = architecture.new_dit_and_vae(device, args.seed)
    logs = []
    for name in names:
        budget = getattr(args, f"budget_{name}")
        if name == "vae":
            logs.append(stages.train_vae(vae, scale, args.seed, device, budget))
        elif name == "ar":
            logs.append(stages.train_ar(ar, scale, args.seed, device, budget))
        else:
            pipeline = checkpoint.pipeline_for(dit, vae, device)
            logs.append(stages.train_dit(pipeline, ar, scale, args.seed, device, budget, lr=args.dit_lr,
                                         shape_weight=args.dit_shape_weight))
        checkpoint.save(args.out, ar, dit, vae)
        print(f"checkpoint written to {args.out} after {name}", flush=True)
    record = {
        "seed": args.seed, "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "scale": args.scale, "continued": continued, "stages": [log.to_dict() for log in logs],
    }
    if "dit" in names and args.eval_budget > 0:
        ar.eval()
        pipeline = checkpoint.pipeline_for(dit, vae, device)
        checks = selfcheck.DEFAULT_CHECKS
        if scale.eval_steps:
            checks = tuple((scale.eval_steps, guidance, scramble) for _, guidance, scramble in checks[:2])
        record["held_out_check"] = selfcheck.held_out_accuracy(ar, pipeline, scale.eval_examples, checks,
                                                               budget_s=args.eval_budget)
        for line in record["held_out_check"]:
            print(f"[check] {line}", flush=True)
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    path = report.append_run(args.log_dir or args.out.parent, record)
    print(f"log written to {path} ({record['wall_seconds']} s in all)", flush=True)
    return record
