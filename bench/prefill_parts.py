"""Where a guided image's AR prefill time goes, and what ar_service's prefill memo saves (one H200, ~1 minute).

    python -m bench.prefill_parts --out $OUT/prefill_parts.json        # Preview shapes, random weights, bf16 then FP8
    python -m bench.prefill_parts --tiny --out prefill_tiny.json       # the tiny model on the CPU

Before its first decode step, a guided 512x512 image with the default negative prompt runs three eager forwards on
ar_service's worker (every stream in the batch waits meanwhile): the negative prompt (the DiT's unconditional
condition), the prompt after the shared system prefix, and the 10-token unconditional row of AR guidance. The memo
(``ar_service.prefill.PrefillMemo``) keeps the first and the last by their ids. Each part is the median wall time
of ``--repeats`` calls after one untimed call, the device synchronised around each: fresh, and as a memo hit.
``stream_ms``: the whole ``DecodeStream`` set-up (prompt prefill, unconditional row, text condition, first draw),
without a memo and with a warm one. ``per_image_ms``: the negative condition plus the stream, both ways.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.report import emit
from bench.timing import median_ms

PROMPT = "A lighthouse on a rocky coast at dusk, waves breaking, warm light in its window, oil painting, highly detailed"
SIZE = 512


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return round(median_ms(fn, device, repeats)[0], 3)


@torch.inference_mode()
def measure(loaded, device: torch.device, repeats: int) -> dict:
    from ar_service import conditions, prefill
    from ar_service.decoding.stream import UNCOND_PROMPT_TOKENS, DecodeStream, UnconditionalRow
    from ar_service.prompt import grid_for_size
    from ar_service.sampling import SamplingParams
    from servicekit.checkpoint import RELEASED_NEGATIVE_PROMPT

    model, tokenizer = loaded.model, loaded.tokenizer
    grid = grid_for_size(SIZE, SIZE, 16)
    prompt_ids = conditions.prompt_ids_for(tokenizer, PROMPT, grid)
    negative_ids = conditions.negative_prompt_ids(tokenizer, RELEASED_NEGATIVE_PROMPT)
    prefix_ids = prefill.system_prefix_ids(tokenizer)
    prefix = prefill.build_prefix_cache(model, prefix_ids)
    warm = prefill.PrefillMemo()

    def stream(memo):
        return DecodeStream(model, prompt_ids, grid, loaded.t2i, SamplingParams(), 0, prefix_ids=prefix_ids,
                            prefix=prefix, reserve=False, guidance=2.0, memo=memo)

    parts = {
        "negative_ms": _median_ms(lambda: prefill.negative_condition_for(model, negative_ids, prefix_ids, prefix), device, repeats),
        "negative_memo_hit_ms": _median_ms(
            lambda: prefill.negative_condition_for(model, negative_ids, prefix_ids, prefix, warm), device, repeats),
        "prompt_prefill_ms": _median_ms(
            lambda: prefill.text_condition_for(model, prompt_ids, prefix_ids=prefix_ids, prefix=prefix), device, repeats),
        "unconditional_row_ms": _median_ms(lambda: UnconditionalRow(model, prompt_ids, grid, False), device, repeats),
        "unconditional_row_memo_hit_ms": _median_ms(
            lambda: UnconditionalRow(model, prompt_ids, grid, False, warm), device, repeats),
        "stream_ms": _median_ms(lambda: stream(None), device, repeats),
        "stream_memo_hit_ms": _median_ms(lambda: stream(warm), device, repeats),
    }
    parts["per_image_ms"] = round(parts["negative_ms"] + parts["stream_ms"], 3)
    parts["per_image_memo_hit_ms"] = round(parts["negative_memo_hit_ms"] + parts["stream_memo_hit_ms"], 3)
    return {"prompt_tokens": len(prompt_ids), "negative_tokens": len(negative_ids), "prefix_tokens": len(prefix_ids),
            "unconditional_tokens": UNCOND_PROMPT_TOKENS, **parts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_parts", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON report")
    parser.add_argument("--tiny", action="store_true", help="the tiny model with its own weights, on the CPU")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per part (the median is reported)")
    args = parser.parse_args(argv)
    from ar_service.model.loading import load_ar
    from ar_service.model.quantize import quantize_ar_
    from ar_service.model.tiny import write_ar_only_root
    from servicekit.fp8 import unsupported_reason

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    root = write_ar_only_root(Path(tempfile.mkdtemp()) / "ar", preview=not args.tiny, weights=args.tiny)
    loaded = load_ar(root, device=device, dtype=dtype, random_weights=not args.tiny)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "model": "tiny" if args.tiny else "preview-random", "size": SIZE,
                    "repeats": args.repeats}
    report[str(dtype).removeprefix("torch.")] = measure(loaded, device, args.repeats)
    if (reason := unsupported_reason(device)) is None:
        quantize_ar_(loaded.model)
        report["fp8"] = measure(loaded, device, args.repeats)
    else:
        report["fp8"] = {"skipped": reason}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
