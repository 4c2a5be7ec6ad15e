"""The DiT's denoise step eagerly against its CUDA graphs (dit_service/model/cuda_graphs.py), on the GPU.

Usage: ``python -m bench.dit_graphs [--sizes 512,1024] [--steps 20] [--deterministic] [--out FILE]``. Builds the
Preview-shaped DiT stage with random bf16 weights and, per size:

- one transformer call (a guided step: the conditional and unconditional rows packed; and the conditional row
  alone): milliseconds per call eagerly (wall, and the CPU time spent issuing it) and replayed from its graph,
  and whether the replay gives the eager result bit for bit;
- a whole denoise (``--steps`` Euler steps through ``DiTPipeline.step``, guidance on every step) both ways:
  seconds, and whether the final latents are bit-identical.

``--deterministic`` first sets what ``dit_service --deterministic`` sets (cuBLAS workspace, deterministic
algorithms), to check that mode too.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path

from bench.report import emit


def _timed(fn, repeats: int, sync) -> tuple[float, float]:
    """(wall ms, CPU ms) per call of ``fn`` over ``repeats`` calls, after the GPU has drained."""
    sync()
    started, cpu = time.perf_counter(), 0.0
    for _ in range(repeats):
        issued = time.perf_counter()
        fn()
        cpu += time.perf_counter() - issued
    sync()
    return (time.perf_counter() - started) / repeats * 1e3, cpu / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dit_graphs", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,1024", help="square image sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--text-positions", type=int, default=123)
    parser.add_argument("--uncond-positions", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.deterministic:  # before CUDA starts, as dit_service does
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from dit_service.model.cuda_graphs import GraphedTransformer
    from dit_service.model.pipeline import DiTPipeline, preview_dit_config
    from dit_service.model.sampler import pack_conditions

    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    pipeline = DiTPipeline.from_config(preview_dit_config(), device="cuda", dtype=torch.bfloat16, random_weights=True)
    dit, sync, hidden = pipeline.transformer, torch.cuda.synchronize, pipeline.condition_dim
    report: dict = {"deterministic": args.deterministic, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "steps": args.steps, "sizes": {}}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for size in (int(s) for s in args.sizes.split(",")):
            grid = size // 16
            cond = pipeline.assemble_condition(
                torch.randn(args.text_positions, hidden, generator=generator),
                torch.randn(grid * (grid + 1), hidden, generator=generator),
            )
            uncond = torch.randn(args.uncond_positions, hidden, generator=generator).to(cond)
            shape = pipeline.latent_shape(size, size)
            result: dict = {"condition_positions": int(cond.shape[0]), "uncond_positions": int(uncond.shape[0])}
            for name, conds in (("guided_pair", [cond, uncond]), ("cond_row", [cond])):
                packed, lengths = pack_conditions(conds)
                x = torch.randn(len(conds), *shape, generator=generator).to("cuda", torch.bfloat16)
                t = torch.full((len(conds),), 0.4, device="cuda")
                graphed = GraphedTransformer(dit, max_graphs=1)
                eager_out = dit(x, t, packed, lengths)
                graphed(x, t, packed, lengths)  # first sight: eager
                graph_out = graphed(x, t, packed, lengths)  # captured, then replayed
                eager_ms, eager_cpu_ms = _timed(partial(dit, x, t, packed, lengths), args.repeats, sync)
                graph_ms, graph_cpu_ms = _timed(partial(graphed, x, t, packed, lengths), args.repeats, sync)
                result[name] = {
                    "eager_ms": round(eager_ms, 2), "eager_cpu_ms": round(eager_cpu_ms, 2),
                    "graph_ms": round(graph_ms, 2), "graph_cpu_ms": round(graph_cpu_ms, 2),
                    "speedup": round(eager_ms / graph_ms, 3),
                    "bit_identical": bool(torch.equal(eager_out, graph_out)),
                    "max_abs_diff": float((eager_out.float() - graph_out.float()).abs().max()),
                    "graph_counts": dict(graphed.counts),
                }
            denoise = {}
            for label, model in (("eager", dit), ("graphs", GraphedTransformer(dit, max_graphs=8))):
                pipeline.step_model = model
                entry = pipeline.start_entry(cond.cpu(), cond.new_zeros(0, hidden).cpu(), uncond.cpu(), size, size,
                                             seed=1, steps=args.steps, guidance=9.0)
                sync()
                started = time.perf_counter()
                while not entry.done:
                    pipeline.step([entry])
                sync()
                denoise[label] = {"s": round(time.perf_counter() - started, 4), "latents": entry.latents.clone()}
            pipeline.step_model = dit
            result["denoise"] = {
                "eager_s": denoise["eager"]["s"], "graphs_s": denoise["graphs"]["s"],
                "speedup": round(denoise["eager"]["s"] / denoise["graphs"]["s"], 3),
                "latents_bit_identical": bool(torch.equal(denoise["eager"]["latents"], denoise["graphs"]["latents"])),
            }
            report["sizes"][size] = result
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
