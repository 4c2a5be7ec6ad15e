"""AR decode batch invariance, and what the fixed-shape padding costs, on any device.

    python -m bench.ar_batch_invariance [--preview] [--device cuda] [--dtype bfloat16] [--max-batch 8] [--size 256]

Runs one image alone and then among ``max_batch - 1`` other streams (other prompts, seeds and sizes, joining
at different steps) through the engine's batched decode (``generation.decode_step``), once padded to
``max_batch`` rows (ardit's way) and once unpadded, and reports whether tokens and hidden states are equal to
the bit, plus the decode step time of one stream unpadded, one stream padded, and a full padded batch.
Prints one JSON object. ``--preview`` uses the Preview-shaped AR with random weights (a GPU is advised).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ar_service.generation import DecodeStream, build_prefix_cache, decode_step, prompt_ids_for, system_prefix_ids
from ar_service.model.loading import load_ar
from ar_service.model.tiny import write_ar_only_root
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preview", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--timing-steps", type=int, default=64)
    parser.add_argument(
        "--deterministic", action="store_true",
        help="torch.use_deterministic_algorithms(True) (set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment on CUDA)",
    )
    args = parser.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    root = write_ar_only_root(Path(tempfile.mkdtemp()) / "ar", preview=args.preview, weights=not args.preview)
    loaded = load_ar(root, device=args.device, dtype=dtype, random_weights=args.preview)
    model, t2i, tok = loaded.model, loaded.t2i, loaded.tokenizer
    sampling = SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p)
    prefix = build_prefix_cache(model, system_prefix_ids(tok))
    p = args.max_batch

    def stream(prompt, w, h, seed, rows=None):
        grid = grid_for_size(w, h, 16)
        cb = None if rows is None else (lambda r, hid, t: rows.append(hid))
        return DecodeStream(model, prompt_ids_for(tok, prompt, grid), grid, t2i, sampling, seed, cb, prefix=prefix)

    def alone(pad: int):
        rows: list[torch.Tensor] = []
        s = stream("a lighthouse at dusk", args.size, args.size, 5, rows)
        running = [s]
        while running:
            running = [x for x in running if x.sample()]
            if running:
                lo, hi = decode_step(model, running, pad)
                s.accept(lo[0:1], hi[0])
        return s.tokens, torch.cat(rows).float().cpu()

    def batched(pad: int):
        rows: list[torch.Tensor] = []
        target = stream("a lighthouse at dusk", args.size, args.size, 5, rows)
        joiners = [stream(f"other scene {k}", args.size // 2 + 16 * k, args.size // 2, 100 + k) for k in range(p - 1)]
        running, step = [target], 0
        while running:
            if step % 5 == 0 and joiners:
                running.append(joiners.pop())
            running = [x for x in running if x.sample()]
            if running:
                lo, hi = decode_step(model, running, pad)
                for b, x in enumerate(running):
                    x.accept(lo[b : b + 1], hi[b])
            step += 1
        return target.tokens, torch.cat(rows).float().cpu()

    def compare(a, b) -> dict:
        (ta, ha), (tb, hb) = a, b
        first_token = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        differs = (ha != hb).any(dim=-1).nonzero()
        return {
            "tokens_equal": ta == tb,
            "hidden_bit_equal": bool(torch.equal(ha, hb)),
            "first_token_differing": first_token,
            "first_hidden_position_differing": None if not len(differs) else int(differs[0, 0]),
            "hidden_max_abs_diff": float((ha - hb).abs().max()),
        }

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step_ms(batch: int, pad: int) -> float:
        streams = [stream(f"timing {k}", args.size, args.size, k) for k in range(batch)]
        for s in streams:
            s.sample()
        for _ in range(3):
            decode_step(model, streams, pad)
        sync()
        start = time.perf_counter()
        for _ in range(args.timing_steps):
            decode_step(model, streams, pad)  # same position re-fed: the cost of a step, not a valid decode
            for s in streams:
                s.cache.length -= 1
        sync()
        return (time.perf_counter() - start) * 1e3 / args.timing_steps

    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": "preview (random)" if args.preview else "tiny",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "max_batch": p,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "alone_twice": compare(first := alone(p), alone(p)),
        "padded": compare(first, batched(p)),
        "unpadded": compare(alone(1), batched(0)),
        "step_ms": {
            "1_stream_unpadded": step_ms(1, 1),
            f"1_stream_padded_to_{p}": step_ms(1, p),
            f"{p}_streams": step_ms(p, p),
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
