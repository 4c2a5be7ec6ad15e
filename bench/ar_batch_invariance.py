"""AR decode: speed and batch invariance of each decoder, on any device.

    python -m bench.ar_batch_invariance [--preview] [--device cuda] [--size 512] [--max-batch 8] [--out FILE]

Decoders: ``eager`` (each stream its own cache, padded batch: the CPU path), ``fast`` (fixed slots, in-place
K/V, CUDA graphs per length bucket), ``fast+compile`` (the same with torch.compile'd layer bodies, the CUDA
default), ``fast+autotune`` (compiled with max-autotune-no-cudagraphs: Inductor times its own matmul kernels)
``fast+compile+lookahead`` (each next step launched before the host has handled the last one), ``fast+triton``
(the Triton kernels, ``+fold``: RMSNorm folded into the linear kernels, ``+lookahead``, ``+deterministic``) and
``fast+deterministic`` (compiled, every step over the whole cache: the deterministic mode). For
each: ms per token decoding one ``--size`` grid alone (CPU sampling included: what a request sees), the step
time of a full batch, and whether one image's tokens and hidden states alone equal those among
``max_batch - 1`` other streams joining late at other sizes (bit for bit). ``--preview`` uses the
Preview-shaped AR with random weights (a GPU is advised). Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ar_service.conditions import prompt_ids_for
from ar_service.decoding.decoders import EagerDecoder, SlotDecoder, decode_together
from ar_service.decoding.stream import DecodeStream
from ar_service.model.loading import load_ar
from ar_service.model.static_decode import StaticDecoder
from ar_service.model.tiny import write_ar_only_root
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from bench.report import emit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preview", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--decoders", default="eager,fast+compile,fast+triton,fast+triton+fold,fast+triton+lookahead,"
                                                "fast+triton+deterministic")
    parser.add_argument("--eager-tokens", type=int, default=200, help="tokens timed for the eager decoder (slow)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    root = write_ar_only_root(Path(tempfile.mkdtemp()) / "ar", preview=args.preview, weights=not args.preview)
    loaded = load_ar(root, device=args.device, dtype=dtype, random_weights=args.preview)
    model, t2i, tok = loaded.model, loaded.t2i, loaded.tokenizer
    sampling = SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p)
    prefix = build_prefix_cache(model, system_prefix_ids(tok))
    p = args.max_batch
    big = grid_for_size(args.size, args.size, 16)
    max_positions = len(prompt_ids_for(tok, "x" * 64, big)) + 64 + big.decode_tokens + 1

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def make(name: str):
        if name == "eager":
            return EagerDecoder(model, p)
        static = StaticDecoder(
            model, p, max_positions, compile="compile" in name or "deterministic" in name or "autotune" in name or "triton" in name,
            compile_mode="max-autotune-no-cudagraphs" if "autotune" in name else "default",
            full_length="deterministic" in name, kernels="triton" if "triton" in name else "torch",
            fold_norms="fold" in name,
        )
        static.lookahead = "lookahead" in name
        return SlotDecoder(static)

    def stream(decoder, prompt, w, h, seed, rows=None):
        grid = grid_for_size(w, h, 16)
        cb = None if rows is None else (lambda r, hid, t: rows.append(hid))
        s = DecodeStream(model, prompt_ids_for(tok, prompt, grid), grid, t2i, sampling, seed, cb, prefix=prefix,
                         reserve=decoder.reserve)
        decoder.admit(s)
        return s

    def run(decoder, streams, joiners=(), limit=None, keep=False):
        """Decodes until every stream is done (or ``limit`` steps; ``keep``: the unfinished keep their slots);
        returns (steps, seconds)."""
        sync()
        start = time.perf_counter()
        steps = decode_together(decoder, streams, list(joiners), join_every=5, max_steps=limit, release_unfinished=not keep)
        sync()
        return steps, time.perf_counter() - start

    def alone(decoder, limit=None):
        rows: list[torch.Tensor] = []
        s = stream(decoder, "a lighthouse at dusk", args.size, args.size, 5, rows)
        steps, seconds = run(decoder, [s], limit=limit)
        return s.tokens, torch.cat(rows).float().cpu() if rows else None, seconds * 1e3 / steps

    def batched(decoder):
        rows: list[torch.Tensor] = []
        target = stream(decoder, "a lighthouse at dusk", args.size, args.size, 5, rows)
        joiners = [stream(decoder, f"other scene {k}", args.size // 2 + 16 * k, args.size // 2, 100 + k)
                   for k in range(p - 1)]
        run(decoder, [target], joiners)
        return target.tokens, torch.cat(rows).float().cpu()

    def full_batch_step_ms(decoder, steps=200):
        streams = [stream(decoder, f"timing {k}", args.size, args.size, k) for k in range(p)]
        run(decoder, streams, limit=8, keep=True)  # warm-up: graphs of the first bucket
        streams = [s for s in streams if not s.done]
        count, seconds = run(decoder, streams, limit=steps)
        return seconds * 1e3 / count

    def compare(a, b) -> dict:
        (ta, ha), (tb, hb) = a, b
        n = min(len(ha), len(hb))
        return {
            "tokens_equal": ta == tb,
            "first_token_differing": next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None),
            "hidden_bit_equal": bool(torch.equal(ha, hb)),
            "hidden_max_abs_diff": float((ha[:n] - hb[:n]).abs().max()) if n else None,
        }

    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": "preview (random)" if args.preview else "tiny",
        "dtype": str(dtype), "torch": torch.__version__, "max_batch": p, "size": args.size,
        "grid_tokens": big.decode_tokens, "decoders": {},
    }
    reference = None
    for name in args.decoders.split(","):
        decoder = make(name)
        started = time.perf_counter()
        alone(decoder, limit=8)  # warm-up (compilation, first graphs)
        warm_s = time.perf_counter() - started
        limit = args.eager_tokens if name == "eager" and cuda else None
        tokens, hidden, ms = alone(decoder, limit)
        entry = {"warmup_s": round(warm_s, 1), "ms_per_token_alone": round(ms, 3), "tokens_timed": len(tokens)}
        if limit is None:
            entry["batch_invariance"] = compare((tokens, hidden), batched(decoder))
            if reference is None:
                reference = (tokens, hidden)
            else:
                entry["vs_first_decoder"] = compare(reference, (tokens, hidden))
        entry[f"ms_per_step_{p}_streams"] = round(full_batch_step_ms(decoder), 3)
        if cuda and name != "eager":  # the GPU time of one step alone (graph replays back to back)
            static = decoder.static
            bucket = min(static.max_positions, 768)
            for rows in sorted({1, p}):
                static._replay(bucket, rows)
                sync()
                started = time.perf_counter()
                for _ in range(100):
                    static._replay(bucket, rows)
                sync()
                entry[f"graph_replay_ms_{rows}_rows_{bucket}_positions"] = round((time.perf_counter() - started) * 10, 3)
        if cuda:
            entry["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["decoders"][name] = entry
        print(name, json.dumps(entry), flush=True)
        del decoder
    emit(result, args.out)


if __name__ == "__main__":
    main()
