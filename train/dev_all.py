"""``python -m train.dev_all --out DIR``: the Dev shapes model that draws from captions and edits from instructions.

Warm-started from the Preview shapes checkpoint (``--warm-start``, default ``train/checkpoints/shapes``: VAE, DiT and
AR tensors of the same name and shape), then MammothTok, AR and DiT, each time-boxed; the checkpoint is written after
each stage, and the in-process check (captions and edits, held out) picks the image guidance default it is served
with. The record goes to ``training_log.json`` beside ``--out`` (or in ``--log-dir``), as ``train.all``'s does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as train.cli: no torch.compile while training

import torch  # noqa: E402

from train import cli, dev_architecture, dev_stages, report, selfcheck, stages  # noqa: E402
from train.shapes import SHAPES, SIZES  # noqa: E402

DEFAULT_WARM_START = Path(__file__).parent / "checkpoints" / "shapes"
#: Seconds of training per stage: about 10 minutes of one H100 in all, with data, conditions and the checks.
DEFAULT_BUDGET_S = {"tok": 30.0, "ar": 100.0, "dit": 330.0}


WEIGHT_NAMES = (*SHAPES, *SIZES)


def parse_target_weight(text: str) -> tuple[str, float]:
    """``--target-weight``'s NAME=FACTOR: NAME a shape or a size of the shapes world, FACTOR a positive number."""
    name, sep, factor = text.partition("=")
    if not sep or name not in WEIGHT_NAMES:
        raise argparse.ArgumentTypeError(f"expected NAME=FACTOR with NAME one of {', '.join(WEIGHT_NAMES)}; got {text!r}")
    try:
        return name, cli.positive_number(factor)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"FACTOR must be a positive finite number; got {factor!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory (replaced)")
    p.add_argument("--warm-start", type=Path, default=DEFAULT_WARM_START, help="the Preview shapes checkpoint")
    p.add_argument("--resume", type=Path,
                   help="continue from this Dev checkpoint (train.dev_all's) instead of a warm start; a stage whose "
                        "budget is 0 is skipped, so --budget-tok 0 --budget-ar 0 trains its DiT further")
    p.add_argument("--log-dir", type=Path, help=f"where {report.LOG_NAME} and {report.PLOT_NAME} go (default: beside --out)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", choices=sorted(dev_stages.SCALES), default="full", help="data and steps (micro: CPU test)")
    for name, seconds in DEFAULT_BUDGET_S.items():
        p.add_argument(f"--budget-{name}", type=float, default=seconds, help=f"seconds of {name} training at most")
    p.add_argument("--dit-batch", type=cli.positive_count, help="DiT batch size (default: the scale's)")
    p.add_argument("--dit-lr", type=float, default=dev_stages.DIT_PEAK_LR, help="DiT peak learning rate")
    p.add_argument("--edit-share", type=float, default=0.5, help="share of DiT batches that are edits")
    p.add_argument("--dit-shape-weight", type=cli.shape_weight, default=0.0, help=cli.SHAPE_WEIGHT_HELP)
    p.add_argument("--qformer-lr-scale", type=cli.positive_number, default=1.0,
                   help="the Q-Former's learning rate as a multiple of --dit-lr (it starts fresh; the rest of the DiT "
                        "comes from Preview)")
    p.add_argument("--target-weight", action="append", default=[], metavar="NAME=FACTOR", type=parse_target_weight,
                   help="draw DiT examples whose target has this shape or size FACTOR times as often (repeatable), "
                        f"e.g. circle=0.5 or small=2; names: {', '.join(WEIGHT_NAMES)}")
    p.add_argument("--dit-captions", type=cli.positive_count,
                   help="captions the DiT's caption batches are drawn from, fresh wordings of the training scenes "
                        f"(default: the scale's; the Preview trainer draws from {stages.SCALES['full'].dit_examples})")
    p.add_argument("--eval-budget", type=float, default=90.0, help="seconds for the in-process checks (0: skip)")
    return p


def run(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    device, scale = cli.start(args, dev_stages.SCALES)
    if args.dit_captions:
        scale = dataclasses.replace(scale, dit_captions=args.dit_captions)
    warm: dict | None = None
    if args.resume:
        ar, dit, vae, tok = dev_architecture.load(args.resume, device, args.seed)
        tok.eval()
        print(f"resumed from {args.resume}", flush=True)
    else:
        ar = dev_architecture.new_ar(device, args.seed)
        dit, vae = dev_architecture.new_dit_and_vae(device, args.seed)
        tok = dev_architecture.new_mammothtok(device, args.seed)
        warm = dev_architecture.warm_start(args.warm_start, ar, dit, vae, device).to_dict()
        print(f"warm start from {args.warm_start}: {warm['tensors_copied']} tensors, {warm['parameters_copied']} "
              f"parameters; fresh {warm['fresh_tensors']}", flush=True)

    def save(serving=dev_architecture.SERVING) -> None:
        dev_architecture.save(args.out, ar, dit, vae, tok, serving)

    logs = []
    if args.budget_tok > 0:
        logs.append(dev_stages.train_mammothtok(tok, scale, args.seed, device, args.budget_tok))
        save()
    prompts = dev_stages.Prompts(tok)
    if args.budget_ar > 0:
        logs.append(dev_stages.train_ar(ar, prompts, scale, args.seed, device, args.budget_ar))
        print(f"[ar] held-out greedy grids exact: {logs[-1].data['held_out_grid_exact']}", flush=True)
        save()
    ar.eval()
    pipeline = dev_architecture.pipeline_for(dit, vae, device)
    logs.append(dev_stages.train_dit(pipeline, ar, prompts, scale, args.seed, device, args.budget_dit,
                                     edit_share=args.edit_share, lr=args.dit_lr,
                                     target_weights=dict(args.target_weight), shape_weight=args.dit_shape_weight,
                                     qformer_lr_scale=args.qformer_lr_scale))
    save()
    print(f"checkpoint written to {args.out}", flush=True)
    record: dict = {"kind": "dev", "seed": args.seed, "scale": args.scale,
                    "resumed_from" if args.resume else "warm_start": str(args.resume or args.warm_start),
                    "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                    "warm_start_report": warm, "stages": [log.to_dict() for log in logs]}
    if args.eval_budget > 0:
        record.update(check(ar, dit, vae, prompts, scale, device, args.eval_budget))
        best = record.get("image_guidance_default")
        if best is not None:
            save(dev_architecture.with_image_guidance(best))
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    path = report.append_run(args.log_dir or args.out.parent, record)
    print(f"log written to {path} ({record['wall_seconds']} s in all)", flush=True)
    return record


def check(ar, dit, vae, prompts, scale, device, budget_s: float) -> dict:
    """Held-out captions (``selfcheck``, with the Dev decode) and held-out edits per kind, at the served steps and text
    guidance; the image guidance whose edits read right most often becomes the served default."""
    ar.eval()
    pipeline = dev_architecture.pipeline_for(dit, vae, device)
    steps = scale.eval_steps or selfcheck.SERVED_STEPS
    guidance = selfcheck.SERVED_GUIDANCE
    checks = ((steps, guidance, False), (steps, guidance, True))
    captions = selfcheck.held_out_accuracy(ar, pipeline, scale.eval_captions, checks, budget_s=budget_s / 3,
                                           decode=prompts.decode_kwargs())
    edits = dev_stages.held_out_edits(ar, pipeline, prompts, scale.eval_edits, steps, guidance,
                                      budget_s=budget_s * 2 / 3)
    for line in captions + edits:
        print(f"[check] {line}", flush=True)
    return {"held_out_check": captions, "held_out_edits": edits,
            "image_guidance_default": dev_stages.best_image_guidance(edits)}


def main(argv: list[str] | None = None) -> None:
    run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
