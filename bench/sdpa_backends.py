"""PyTorch's attention backends at the Preview DiT's attention shapes (one GPU): which is fastest, and how far each
is from the others' output.

    python -m bench.sdpa_backends [--out FILE]

Shapes: 21 query heads, 7 key/value heads, head_dim 120 (dit_service/model/pipeline.py ``preview_gen_parts``), one
sample, sequence lengths of a 1024x1024 render's conditional call (4,096 image tokens + a 77-token caption + a
32x33 image condition), its image tokens alone, and a 512x512 conditional call. For each of flash, cuDNN and memory
efficient attention: with grouped-query attention (``enable_gqa``, as the DiT calls it) and with the key/value
heads repeated; ms per call (CUDA events, after warm-up) and the largest difference from the default backend's
output on the repeated heads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.report import emit
from bench.timing import queued_mean_ms

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
HEADS, KV_HEADS, HEAD_DIM = 21, 7, 120
SEQUENCES = (4096 + 77 + 32 * 33, 4096, 1024 + 77 + 16 * 33)


def measure(length: int, device: torch.device) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, HEADS, length, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(1, KV_HEADS, length, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    groups = HEADS // KV_HEADS
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)).float()
    out: dict = {}
    for name, backend in BACKENDS.items():
        for gqa in (True, False):
            if gqa:
                def call():
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            else:
                def call():
                    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
            key = f"{name}_{'gqa' if gqa else 'expanded'}"
            try:
                with sdpa_kernel([backend]):
                    error = float((call().float() - reference).abs().max())
                    out[key] = {"ms": round(queued_mean_ms(call), 4), "max_err": error}
            except RuntimeError as exc:  # "No available kernel": the backend takes no such call
                out[key] = {"error": str(exc)[:200]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sdpa_backends", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version()}
    for length in SEQUENCES:
        report[f"S={length}"] = measure(length, device)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
