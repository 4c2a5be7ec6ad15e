"""Where a DiT denoise step's time goes, in bf16 and in FP8 (a GPU is advised).

    python -m bench.dit_profile [--sizes 1024] [--out FILE]

For each precision (bf16, then the same weights quantized as the service's ``--quantization fp8`` does) and image
size it reports: the guided step replayed from the service's CUDA graphs (ms); one eager step under
torch.profiler, its kernel time summed by kind (matmul, attention, FP8 activation quantizer, compiled elementwise
kernels, other) and its heaviest kernels; and the rows each block linear multiplies at that size. Then, at those
rows, each block linear's shape alone, timed in a CUDA graph: the bf16 product (cuBLAS), the FP8 row-wise product
on the padded weight, the activation quantizer alone (and the same arithmetic compiled from torch ops), and the
same for the fused weights the FP8 path could use (q/k/v as one [N, K] and the feed-forward's gate/up as one).
Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.decode_profile import graph_ms
from bench.fp8_check import DiTBench
from bench.report import emit
from servicekit import fp8, fp8_kernels

KINDS = (  # first match wins; lower-cased kernel names (cuBLAS names bf16 and FP8 products alike: "nvjet_...")
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("fp8 quantizer", ("quantize_rows",)),
    ("matmul", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas")),
    ("compiled elementwise", ("triton",)),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), "other")


def linear_rows(bench: DiTBench, size: int) -> int:
    """The rows the first joint block's q projection multiplies in one guided step of ``size``."""
    seen = []
    layer = bench.pipeline.transformer.layers[0].attn.to_q
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].numel() // args[0].shape[-1]))
    try:
        bench.pipeline.step([bench.entry(size)])
    finally:
        handle.remove()
    return seen[0]


def kernel_profile(bench: DiTBench, size: int, steps: int = 2, top: int = 15) -> dict:
    """One eager guided step's CUDA kernels (mean over ``steps``), summed by kind, and the heaviest ones."""
    from torch.profiler import ProfilerActivity, profile

    model, bench.pipeline.step_model = bench.pipeline.step_model, bench.pipeline.transformer
    try:
        entry = bench.entry(size)
        for _ in range(2):
            bench.pipeline.step([entry])
        bench.pipeline.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                bench.pipeline.step([entry])
            bench.pipeline.synchronize()
    finally:
        bench.pipeline.step_model = model
    by_name: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name] += event.device_time_total / 1e3 / steps
            counts[event.name] += 1
    by_kind: dict[str, float] = collections.Counter()
    for name, ms in by_name.items():
        by_kind[kind_of(name)] += ms
    heaviest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {
        "kernel_ms": round(sum(by_name.values()), 3),
        "by_kind_ms": {kind: round(ms, 3) for kind, ms in sorted(by_kind.items(), key=lambda item: -item[1])},
        "heaviest": [{"kernel": name[:160], "kind": kind_of(name), "ms": round(ms, 3), "calls": counts[name] // steps}
                     for name, ms in heaviest],
    }


def linear_shapes(bench: DiTBench) -> dict[str, tuple[int, int]]:
    """[N, K] of each block linear role, and of the fused weights (q/k/v, gate/up) the FP8 path could use."""
    block = bench.pipeline.transformer.layers[0]
    shape = lambda m: tuple(m.weight.shape)  # noqa: E731
    attn, ffn = block.attn, block.feed_forward
    q, k, v = shape(attn.to_q), shape(attn.to_k), shape(attn.to_v)
    up = shape(ffn.linear_1)
    return {"q": q, "k": k, "v": v, "qkv (fused)": (q[0] + k[0] + v[0], q[1]), "out": shape(attn.to_out[0]),
            "gate": up, "up": shape(ffn.linear_3), "gate/up (fused)": (2 * up[0], up[1]), "down": shape(ffn.linear_2)}


def gemm_table(shapes: dict[str, tuple[int, int]], rows: int, device: torch.device) -> dict:
    """Each shape at ``rows``, in ms: bf16 cuBLAS; FP8 row-wise on the padded weight; the activation quantizer
    alone, as the service runs it (``fp8_kernels``, one pass) and as the same arithmetic compiled from torch ops;
    the FP8 product with its quantizer. For the down projection also the SwiGLU before it: compiled in bf16 and then
    quantized, against ``fp8_kernels``' fused SwiGLU-quantizer. TFLOP/s of the bf16 and FP8 products."""
    return {role: _gemm_row(n, k, rows, device, with_swiglu=role == "down") for role, (n, k) in shapes.items()}


def _gemm_row(n: int, k: int, rows: int, device: torch.device, with_swiglu: bool) -> dict:
    from dit_service.model.layers import _swiglu, fused_on_cuda

    compiled_quantizer = fused_on_cuda(fp8.quantize_rows)
    width = fp8.padded(k)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    wq, ws = fp8.quantize_weight(F.pad(w, (0, width - k, 0, fp8.padded(n) - n)))
    xq, xs = fp8.quantize_rows(x, width)
    bf16 = graph_ms(lambda: F.linear(x, w))
    fp8_ms = graph_ms(lambda: fp8.scaled_mm(xq, xs, wq, ws, torch.bfloat16))
    flop = 2 * rows * n * k
    row = {"n": n, "k": k, "bf16_ms": bf16, "fp8_ms": fp8_ms,
           "quantizer_ms": graph_ms(lambda: fp8_kernels.quantize_rows(x, width)),
           "quantizer_compiled_ms": graph_ms(lambda: compiled_quantizer(x, width)),
           "fp8_with_quantizer_ms": graph_ms(
               lambda: fp8.scaled_mm(*fp8_kernels.quantize_rows(x, width), wq, ws, torch.bfloat16)),
           "bf16_tflops": flop / bf16 / 1e9, "fp8_tflops": flop / fp8_ms / 1e9}
    if with_swiglu:
        gate, up = torch.randn(2, rows, k, device=device, dtype=torch.bfloat16)
        row["swiglu_then_quantizer_ms"] = graph_ms(lambda: fp8_kernels.quantize_rows(_swiglu(gate, up), width))
        row["swiglu_quantizer_ms"] = graph_ms(lambda: fp8_kernels.triton_swiglu_quantize_rows(gate, up, width))
    row["fp8_speedup"] = bf16 / fp8_ms
    row["fp8_with_quantizer_speedup"] = bf16 / row["fp8_with_quantizer_ms"]
    return {key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dit_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024", help="image sizes, comma-separated (512, 1024)")
    parser.add_argument("--out", type=Path, help="JSON report")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.dit_profile needs a CUDA GPU")
    device = torch.device("cuda")
    sizes = [int(s) for s in args.sizes.split(",")]
    bench = DiTBench(False, device, torch.bfloat16)
    bench.sizes = sizes
    report: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "sizes": sizes}
    report["rows"] = {str(size): linear_rows(bench, size) for size in sizes}
    shapes = linear_shapes(bench)
    for precision in ("bf16", "fp8"):
        if precision == "fp8":
            bench.quantize()
        report[precision] = {"step_ms": bench.step_ms(),
                             "profile": {str(size): kernel_profile(bench, size) for size in sizes}}
    report["gemms"] = {str(size): gemm_table(shapes, report["rows"][str(size)], device) for size in sizes}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
