"""Packed against sequential classifier-free guidance on the GPU, measured against bf16's own error.

Usage: ``python -m bench.cfg_modes_check [--size 1024]``. Builds the Preview-shaped DiT stage with
random weights in bf16 on CUDA, computes one guided velocity both ways for the same inputs, and
compares the difference with the bf16-vs-float32 difference of the sequential result (same weights,
cast up). Packed is within bf16 tolerance when its gap to sequential is no larger than bf16's own.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dit_service.model.pipeline import DiTPipeline, preview_dit_config
from dit_service.model.sampler import pack_conditions


def guided(transformer, x, t, cond, uncond, guidance, mode):
    if mode == "packed":
        packed, lengths = pack_conditions([cond, uncond])
        both = transformer(x.expand(2, -1, -1, -1), t.expand(2), packed, lengths).float()
        c, u = both[:1], both[1:]
    else:
        c = transformer(x, t, cond[None]).float()
        u = transformer(x, t, uncond[None]).float()
    return u + guidance * (c - u)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cfg_modes_check", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--text-positions", type=int, default=77)
    parser.add_argument("--guidance", type=float, default=9.0)
    args = parser.parse_args(argv)
    pipeline = DiTPipeline.from_config(preview_dit_config(), device="cuda", dtype=torch.bfloat16, random_weights=True)
    g = torch.Generator().manual_seed(0)
    grid = args.size // 16
    text = torch.randn(args.text_positions, pipeline.condition_dim, generator=g)
    image = torch.randn(grid * (grid + 1), pipeline.condition_dim, generator=g)
    cond = pipeline.assemble_condition(text, image)
    uncond = cond.new_zeros(0, cond.shape[1])
    x = torch.randn(1, 16, args.size // 8, args.size // 8, generator=g).cuda()
    t = torch.tensor([0.5], device="cuda")
    dit = pipeline.transformer
    seq = guided(dit, x.bfloat16(), t.bfloat16(), cond, uncond, args.guidance, "sequential")
    packed = guided(dit, x.bfloat16(), t.bfloat16(), cond, uncond, args.guidance, "packed")
    dit32 = dit.float()
    ref = guided(dit32, x, t, cond.float(), uncond.float(), args.guidance, "sequential")
    report = {
        "size": args.size,
        "condition_positions": int(cond.shape[0]),
        "rel_err_packed_vs_sequential_bf16": rel(packed, seq),
        "rel_err_sequential_bf16_vs_fp32": rel(seq, ref),
        "rel_err_packed_bf16_vs_fp32": rel(packed, ref),
    }
    report["within_bf16_tolerance"] = report["rel_err_packed_vs_sequential_bf16"] <= 1.5 * report["rel_err_sequential_bf16_vs_fp32"]
    print(json.dumps(report, indent=2))
    return 0 if report["within_bf16_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
