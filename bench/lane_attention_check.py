"""The torch kernels' two in-place reads of a step of lanes side by side on CUDA: ``decode_kernels.attention`` once a
row (``lane_attention`` "triton") and once for a slot's rows (``lane_groups``, "triton-slots"), at Preview's attention
shapes (28 heads, 4 kv heads, head_dim 128, bf16, 32 slots of 2,304 positions), for a few step widths: each against
torch's masked attention (``static_decode._attend``), and one layer's time of each.

Usage (CUDA machine): ``python -m bench.lane_attention_check [--out FILE]``. It prints one line per width and "ALL OK"
when both reads agree with torch's everywhere; the widths' figures decide ``static_decode.GROUPED_LANE_ROWS``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ar_service.model import decode_kernels
from ar_service.model.static_decode import _attend
from bench.timing import queued_mean_ms

HEADS, KV_HEADS, HEAD_DIM, SLOTS, LENGTH = 28, 4, 128, 32, 2304
FREE_POSITION = 2100
#: (rows, streams): a step's rows, spread evenly over this many slots (16 row-parallel streams at 256 and 64 rows,
#: two at 34, one at 18).
WIDTHS = [(256, 16), (64, 16), (34, 2), (18, 1)]
TOLERANCE = 2e-2  # bf16 inputs, float32 accumulation


def check_width(rows: int, streams: int, generator: torch.Generator) -> dict:
    """One step width: ``rows`` rows spread evenly over ``streams`` slots at random lengths, both reads against
    torch's and timed."""
    device = torch.device("cuda")
    per = rows // streams
    slots = torch.arange(streams).repeat_interleave(per).to(device)
    starts = torch.randint(200, FREE_POSITION - per, (streams,), generator=generator)
    positions = torch.cat([starts[s] + torch.arange(per) for s in range(streams)]).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    q, k, v = rand(rows, HEADS, HEAD_DIM), rand(SLOTS, KV_HEADS, LENGTH, HEAD_DIM), rand(SLOTS, KV_HEADS, LENGTH, HEAD_DIM)
    scale = 1 / math.sqrt(HEAD_DIM)
    groups = decode_kernels.lane_groups(slots, decode_kernels.lanes_per_group(HEADS // KV_HEADS), SLOTS)

    def per_row():
        return decode_kernels.attention(q, k, v, positions, slots, scale, free_position=FREE_POSITION)

    def per_slot():
        return decode_kernels.attention(q, k, v, positions, slots, scale, free_position=FREE_POSITION, groups=groups)

    expected = _attend(q.float(), k[slots].float(), v[slots].float(), positions, scale)
    errors = {name: (fn().float() - expected).abs().max().item() for name, fn in (("per_row", per_row), ("per_slot", per_slot))}
    return {"rows": rows, "streams": streams, "max_error": errors, "ok": max(errors.values()) < TOLERANCE,
            "layer_us": {"per_row": queued_mean_ms(per_row, 50) * 1e3, "per_slot": queued_mean_ms(per_slot, 50) * 1e3}}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and decode_kernels.available):
        raise SystemExit("bench.lane_attention_check needs a CUDA device and the triton package")
    generator = torch.Generator().manual_seed(0)
    results = [check_width(rows, streams, generator) for rows, streams in WIDTHS]
    for r in results:
        print(f"rows {r['rows']} streams {r['streams']}: max|err| once a row {r['max_error']['per_row']:.2e}, once a "
              f"slot {r['max_error']['per_slot']:.2e} {'OK' if r['ok'] else 'MISMATCH'}; one layer's attention once a "
              f"row {r['layer_us']['per_row']:.1f} us, once a slot {r['layer_us']['per_slot']:.1f} us")
    print("ALL OK" if all(r["ok"] for r in results) else "MISMATCH")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "widths": results}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
