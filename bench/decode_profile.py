"""Where an AR decode step's time goes, and what each kernel choice costs (a GPU is advised).

    python -m bench.decode_profile [--preview] [--rows 1,8] [--positions 700,4200] [--tune] [--tune-rows 1,64]
        [--tune-roles gate_up,down] [--quantization fp8] [--out FILE]

For each kernel set of ``--kernels`` ("torch": cuBLAS, torch.compile'd layer bodies, length buckets; "triton":
``ar_service/model/decode_kernels.py``; "triton+fold": the same with the RMSNorm folded into the linear kernels)
it reports: the replay time of one captured step for each row count
and cached length; the time of the step's linear layers alone (every layer's weights once, in a graph) with
cuBLAS and with the Triton kernel, as bytes read / time against the measured copy bandwidth; the sampler alone;
and the heaviest kernels of one step (torch.profiler). ``--tune`` times a grid of block shapes of the Triton
linear kernel for each weight shape (of ``--tune-roles``, at each row count of ``--tune-rows``: the row tile follows
the rows). ``--quantization fp8`` profiles the model with FP8 weights (as the service's ``--quantization fp8`` loads
it): the Triton kernels read e4m3 and the tune covers their block shapes, each beside the same kernel on the
dequantized bf16 weights; the cuBLAS lines then run on the bf16 weights the FP8 ones came from, the baseline FP8 has
to beat. At a row count whose tile is the dot-free kernel's (``decode_kernels.GEMV_TILES``: 2 rows) the FP8 tune
covers that kernel's block shapes, beside the tensor-core kernel on the bf16 weights at its default shape. Prints one
JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ar_service.model import decode_kernels
from ar_service.model.loading import load_ar
from ar_service.model.static_decode import StaticDecoder
from ar_service.model.tiny import write_ar_only_root
from ar_service.sampling import RowSampling, SamplingParams, sample_rows
from bench.bounds import copy_bandwidth
from bench.report import emit
from servicekit.fp8 import QUANTIZATIONS, dequantize


def graph_ms(fn, repeats: int = 20) -> float:
    """Mean time of ``fn`` captured once in a CUDA graph and replayed ``repeats`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def set_rows(static: StaticDecoder, rows: int, position: int) -> None:
    start = static.config.gen_vocab_start_index
    static._long[:rows, 0] = start + 7
    static._long[:rows, 1] = position


def step_ms(static: StaticDecoder, rows: int, position: int) -> float:
    set_rows(static, rows, position)
    bucket, _, _ = static.shape_for(list(range(rows)), [position] * rows)
    graph, _, _ = static._capture(bucket, rows)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50


def linear_calls(static: StaticDecoder, rows: int) -> dict[str, list]:
    """The step's linear layers as the Triton step calls them, by role: (input, weight, keyword extras) for every
    layer's fused q/k/v (with RMSNorm and bias), o (with residual), fused gate/up (with RMSNorm and SwiGLU), down
    (with residual); the generation head. FP8 weights come with their per-row ``scale``."""
    model = static.model
    hidden, inner = model.config.hidden_size, static._layer_weights[0][8].shape[1]
    x = torch.randn(rows, hidden, device=static.device, dtype=model.dtype)
    calls: dict[str, list] = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for i, (n1, e1, qkv_w, qkv_b, ow, n2, e2, gate_up_w, dw) in enumerate(static._layer_weights):
        qkv_s, o_s, gate_up_s, down_s = static._layer_scales[i] or (None, None, None, None)
        calls["qkv"].append((x, qkv_w, {"bias": qkv_b, "norm": (n1, e1), "scale": qkv_s}))
        calls["o"].append((x, ow, {"residual": x, "scale": o_s}))
        calls["gate_up"].append((x, gate_up_w, {"norm": (n2, e2), "swiglu": True, "scale": gate_up_s}))
        calls["down"].append((torch.randn(rows, inner, device=x.device, dtype=x.dtype), dw, {"residual": x, "scale": down_s}))
    calls["gen_head"] = [(x, model.gen_head.weight, {"scale": getattr(model.gen_head, "weight_scale", None)})]
    return calls


def cublas_weight(weight: torch.Tensor, extra: dict, dtype: torch.dtype) -> torch.Tensor:
    """The weight cuBLAS multiplies by: itself, or for an FP8 weight the bf16 one it was quantized from."""
    scale = extra.get("scale")
    return weight if scale is None else dequantize(weight, scale, dtype)


def calls_bytes(calls: dict[str, list]) -> int:
    return sum(w.numel() * w.element_size() for group in calls.values() for _, w, _ in group)


def linears_ms(calls: dict[str, list], kind: str, blocks=None) -> float:
    """All ``calls`` in one graph: plain cuBLAS linears, or the Triton kernel with the step's extras folded in."""
    group = [c for cs in calls.values() for c in cs]
    if kind == "cublas":
        plain = [(x, cublas_weight(w, extra, x.dtype)) for x, w, extra in group]
        return graph_ms(lambda: [F.linear(x, w) for x, w in plain])
    return graph_ms(lambda: [decode_kernels.linear(x, w, blocks=blocks, **extra) for x, w, extra in group])


def dequantized(group: list) -> list:
    """The calls with each FP8 weight replaced by the bf16 one it came from: the Triton kernel on bf16 weights."""
    return [(x, cublas_weight(w, extra, x.dtype), {**extra, "scale": None}) for x, w, extra in group]


#: Block shapes (BLOCK_N, BLOCK_K, warps, stages) that --tune times for every weight shape; for FP8 weights, each
#: also on the same weights dequantized to bf16 (what the bytes saved have to beat, in the same kernel).
TUNE_GRID = [*itertools.product((32, 64), (256, 512), (4,), (4, 5)),
             (16, 512, 4, 5), (32, 256, 4, 6), (128, 256, 4, 4), (64, 256, 8, 5), (128, 128, 4, 5), (32, 128, 4, 3)]


#: Block shapes (BLOCK_N, BLOCK_K, warps, stages) of the dot-free kernel (FP8 weights at its row tile). A warp's 32
#: threads take 256 columns, 8 each: with BLOCK_K >= 256 x warps a thread holds its columns of all BLOCK_N rows (the
#: input loaded and widened once for them), with less the warps split the rows. Few rows and warps give many
#: programs; more rows per thread re-read the input less; stages are the loads in flight.
GEMV_TUNE_GRID = [(2, 512, 1, 1), (2, 512, 1, 3), (4, 512, 1, 3), (2, 512, 1, 4), (4, 512, 1, 4), (8, 512, 1, 3),
                  (2, 512, 2, 3), (4, 512, 2, 3), (8, 512, 2, 3), (2, 1024, 2, 2), (4, 1024, 2, 2), (4, 256, 4, 3),
                  (8, 256, 8, 3), (16, 256, 8, 3), (4, 512, 4, 3), (8, 512, 4, 3), (16, 512, 8, 3)]


def tune(calls: dict[str, list], gb_per_s: float, roles: list[str] | None = None) -> dict:
    """The grid of block shapes for each role's weights, at the rows of ``calls`` (their row tile). An FP8 weight
    on the dot-free kernel is compared with its bf16 weight on the tensor-core kernel's default shape; on the
    tensor-core kernel, with its bf16 weight at each shape of the grid."""
    report = {}
    for name, group in calls.items():
        if roles and name not in roles:
            continue
        nbytes = calls_bytes({name: group})
        one = {name: group}
        x, weight, extra = group[0]
        tile = decode_kernels.row_tile(x.shape[0])
        gemv = decode_kernels.uses_gemv(weight, tile)
        variants = {str(blocks): (group, blocks) for blocks in (GEMV_TUNE_GRID if gemv else TUNE_GRID)}
        if gemv:
            variants["default bf16 weights"] = (dequantized(group), None)
        elif extra.get("scale") is not None:
            variants.update({f"{blocks} bf16 weights": (dequantized(group), blocks) for blocks in TUNE_GRID})
        results = {"cublas": linears_ms(one, "cublas")}
        for key, (variant, blocks) in variants.items():
            try:
                results[key] = linears_ms({name: variant}, "triton", blocks)
            except Exception as error:  # a shape the compiler refuses (shared memory)
                results[key] = repr(error)[:80]
        timed = {k: v for k, v in results.items() if isinstance(v, float)}
        best = min((k for k in timed if k != "cublas" and "bf16 weights" not in k), key=timed.get)
        default = str(decode_kernels.default_blocks(weight, tile, bool(extra.get("swiglu"))))
        report[name] = {
            "shape": list(weight.shape), "count": len(group), "mb": round(nbytes / 1e6, 1),
            "cublas_ms": round(timed["cublas"], 4), "cublas_vs_copy": round(nbytes / timed["cublas"] / 1e6 / gb_per_s, 3),
            "default_blocks": default, "default_ms": round(linears_ms(one, "triton"), 4),
            "best_blocks": best, "best_ms": round(timed[best], 4),
            "best_vs_copy": round(nbytes / timed[best] / 1e6 / gb_per_s, 3),
            "top5": sorted(((round(v, 4), k) for k, v in timed.items()))[:5],
        }
        bf16 = {k: v for k, v in timed.items() if "bf16 weights" in k}
        if bf16:
            best_bf16 = min(bf16, key=bf16.get)
            report[name].update(best_bf16_weights=best_bf16, best_bf16_weights_ms=round(bf16[best_bf16], 4))
        print("tune", name, json.dumps(report[name]), flush=True)
    return report


def sampler_ms(static: StaticDecoder, rows: int) -> float:
    v = static.config.gen_vocab_size
    logits = torch.randn(rows, v, device=static.device, dtype=static.model.dtype)
    start = static.config.gen_vocab_start_index
    draws = RowSampling.build([((start, start + v - 1), SamplingParams(1.0, 50, 1.0), k, 3) for k in range(rows)],
                              static.device)
    return graph_ms(lambda: sample_rows(logits, start, draws))


def kernel_table(static: StaticDecoder, rows: int, position: int, top: int = 25) -> list:
    set_rows(static, rows, position)
    bucket, _, _ = static.shape_for(list(range(rows)), [position] * rows)
    static._forward(bucket, rows)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            static._forward(bucket, rows)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 3
    rows_out = [{"kernel": e.key[:90], "calls_per_step": e.count // 3, "us_per_step": round(e.device_time_total / 3, 1)}
                for e in events[:top]]
    return [{"kernel_us_per_step_total": round(total, 1), "kernels_per_step": sum(e.count for e in events) // 3}, *rows_out]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preview", action="store_true")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--positions", default="700,4200")
    parser.add_argument("--kernels", default="torch,triton,triton+fold",
                        help="kernel sets to compare (triton+fold: RMSNorm folded into the linear kernels)")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-rows", default="1", help="row counts the tune runs at (comma-separated)")
    parser.add_argument("--tune-roles", default="", help="weights the tune runs for (default all: qkv,o,gate_up,down,gen_head)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                        help="fp8: the model as the service loads it with --quantization fp8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    root = write_ar_only_root(Path(tempfile.mkdtemp()) / "ar", preview=args.preview, weights=not args.preview)
    model = load_ar(root, device="cuda", dtype=torch.bfloat16, random_weights=args.preview,
                    quantization=args.quantization).model
    bandwidth = copy_bandwidth("cuda")["gb_per_s"]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gb_per_s": bandwidth,
              "quantization": args.quantization, "kernels": {}}
    print("copy GB/s", bandwidth, flush=True)
    slots, max_positions = max(rows_list), max(positions) + 64
    for kernels in args.kernels.split(","):
        static = StaticDecoder(model, slots, max_positions, compile=True, kernels=kernels.removesuffix("+fold"),
                               fold_norms=kernels.endswith("+fold"))
        entry = {"step_ms": {}, "sampler_ms": {}}
        for rows in rows_list:
            entry["sampler_ms"][rows] = round(sampler_ms(static, rows), 4)
            for position in positions:
                entry["step_ms"][f"{rows} rows @ {position}"] = round(step_ms(static, rows, position), 4)
        entry["kernel_table_1_row"] = kernel_table(static, 1, positions[0])
        result["kernels"][kernels] = entry
        print(kernels, json.dumps(entry), flush=True)
        last = static
    nbytes = calls_bytes(linear_calls(last, 1))
    result["linears"] = {"weight_gb": round(nbytes / 1e9, 3), "bound_ms": round(nbytes / 1e6 / bandwidth, 4)}
    for rows in rows_list:
        calls = linear_calls(last, rows)
        for kind in ("cublas", "triton"):
            ms = linears_ms(calls, kind)
            result["linears"][f"{kind}_{rows}_rows_ms"] = round(ms, 4)
            result["linears"][f"{kind}_{rows}_rows_vs_copy"] = round(nbytes / ms / 1e6 / bandwidth, 3)
    print("linears", json.dumps(result["linears"]), flush=True)
    if args.tune:
        for rows in (int(r) for r in args.tune_rows.split(",")):
            result[f"tune_{rows}_row" + "s" * (rows > 1)] = tune(linear_calls(last, rows), bandwidth,
                                                                 [r for r in args.tune_roles.split(",") if r])
    emit(result, args.out)


if __name__ == "__main__":
    main()
