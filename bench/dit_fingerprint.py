"""A DiT build's fingerprint: what it computes (digests) and how fast (graphed step ms), so two builds of the code can
be compared on one card: is a kernel change bit-identical, and what did it buy.

    python -m bench.dit_fingerprint --out FILE [--repeats 3]       # Preview-shaped random bf16 weights, CUDA
    python -m bench.dit_fingerprint --tiny --device cpu --out FILE  # the tiny DiT (a dry run)

Run it once from each tree (``cd OLD && python -m bench.dit_fingerprint ...``, then from the new one) on the same
card. Weights are random from a fixed seed (``--seed``), so equal digests mean equal arithmetic. Reported: the digest of one guided
velocity at the largest size (packed CFG, eager: ``DiTBench.velocity``), the digest of a fixed-seed render's pixels
at ``DiTBench.image_size`` (CUDA graphs on CUDA, as dit_service) with its wall time, and ``--repeats`` rounds of the
guided step's mean wall time per size (``DiTBench.step_ms``, 10 steps a round).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np
import torch

from bench.fp8_check import DiTBench
from bench.report import emit


def digest(values) -> str:
    """First 16 hex digits of the SHA-256 of the values' bytes (a tensor as float32, an array as it is)."""
    array = values.detach().float().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def fingerprint(tiny: bool, device: torch.device, repeats: int, seed: int = 0) -> dict:
    import dit_service

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    bench = DiTBench(tiny, device, dtype, seed=seed)
    velocity = bench.velocity(bench.pipeline.transformer, dtype)
    image = bench.image("render")
    return {
        "code": str(Path(dit_service.__file__).parent),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
        "velocity_digest": digest(velocity),
        "render": {**image, "pixels_digest": digest(bench.images["render"])},
        "step_ms": [bench.step_ms(10) for _ in range(repeats)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dit_fingerprint", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the tiny DiT instead of Preview's shapes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of step timing")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    args = parser.parse_args(argv)
    emit(fingerprint(args.tiny, torch.device(args.device), args.repeats, args.seed), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
