"""Where a saturated fast-decode step goes, host against device: N guided streams of one decoding mode decode
together in one slot decoder (the engine's token loop without the engine), and each step's wall time is split into
the forward's time and the host's rest (each row's inputs, the passes of lanes, each stream's bookkeeping).

    python -m bench.lane_steps [--preview] [--mode row_parallel] [--window 4] [--streams 16] [--lane-rows 0]
        [--steps 160] [--size 512] [--out FILE]

Why: at 16 clients on an H100 a row-parallel step of about 206 rows took 74 ms of the engine's wall time, where the
device profile gives a step about 0.08 ms a row (bench/results/h100/saturation-wide/NOTES.md). This says how much of
such a step is the host's. The tiny model (the default) runs on the CPU, where the forward's time is its wall time;
``--preview`` builds the Preview shapes with random bf16 weights on CUDA (torch kernels, compiled, every graph
captured first), where it is the device time of each step's upload and replay (both: ``StaticDecoder.device_timing``).
Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ar_service.conditions import prompt_ids_for
from ar_service.decoding import SEQUENTIAL, Decoding
from ar_service.decoding.decoders import SlotDecoder
from ar_service.decoding.stream import DecodeStream
from ar_service.model.loading import load_ar
from ar_service.model.static_decode import StaticDecoder, lane_rows_for
from ar_service.model.tiny import write_ar_only_root
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from bench.report import emit

#: The released guidance scale of the AR (``generate_t2i``'s default, ar_service's ``ar_cfg_scale``).
GUIDANCE = 6.0
#: Pixels a visual token covers at the released 32x32 grid of a 512x512 image.
PIXELS_PER_TOKEN = 16


def measure(loaded, device: torch.device, mode: str, window: int, streams: int, lane_rows: int, steps: int,
            size: int) -> dict:
    """Decodes ``streams`` guided images of ``mode`` together for up to ``steps`` steps; returns the split."""
    grid = grid_for_size(size, size, PIXELS_PER_TOKEN)
    prompts = [prompt_ids_for(loaded.tokenizer, f"a photograph of object number {i} on a table", grid)
               for i in range(streams)]
    slots = 2 * streams
    max_positions = max(len(ids) for ids in prompts) + grid.decode_tokens + 2
    cuda = device.type == "cuda"
    static = StaticDecoder(loaded.model, slots, max_positions, compile=cuda, shared_slots=True,
                           lane_rows=lane_rows_for(lane_rows, slots, "torch"))
    static.warm_up(max_positions, lanes=True)
    decoder = SlotDecoder(static)
    decoding = None if mode == SEQUENTIAL else Decoding(mode, window)
    running = []
    for seed, ids in enumerate(prompts):
        stream = DecodeStream(loaded.model, ids, grid, loaded.t2i, SamplingParams(1.0, 2048, 1.0), seed,
                              reserve=False, guidance=GUIDANCE, decoding=decoding)
        decoder.admit(stream)
        running.append(stream)
    static.device_timing, static.device_ms = True, 0.0
    rows = tokens = taken = 0
    started = time.perf_counter()
    while running and taken < steps:
        feed = []
        for stream in running:  # as decode_together: a stream that has drawn its last token gives its slots back
            if stream.sample():
                feed.append(stream)
            else:
                decoder.release(stream)
        running = feed
        if not feed:
            break
        for stream, share in zip(feed, decoder.step(feed), strict=True):
            rows += len(share.tokens) * (2 if stream.uncond is not None else 1)
            tokens += stream.advance(share)
        taken += 1
    wall_ms = (time.perf_counter() - started) * 1000
    for stream in running:
        decoder.release(stream)
    forward_ms = static.device_ms
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "mode": mode, "window": window if decoding else 0, "streams": streams, "slots": slots,
        "lane_rows": static.lane_rows, "size": size, "grid": f"{grid.width}x{grid.height}",
        "steps": taken, "rows_per_step": round(rows / taken, 2), "tokens_per_step": round(tokens / taken, 2),
        "step_ms": round(wall_ms / taken, 3), "forward_ms": round(forward_ms / taken, 3),
        "host_ms": round((wall_ms - forward_ms) / taken, 3),
        "host_us_per_row": round((wall_ms - forward_ms) * 1000 / rows, 2),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preview", action="store_true", help="Preview shapes, random bf16 weights, on CUDA")
    parser.add_argument("--mode", choices=[SEQUENTIAL, "speculative", "row_parallel"], default="row_parallel")
    parser.add_argument("--window", type=int, default=4, help="ar_decoding_window of the mode")
    parser.add_argument("--streams", type=int, default=16, help="guided images decoding together")
    parser.add_argument("--lane-rows", type=int, default=0, help="decode_lane_rows (0: auto)")
    parser.add_argument("--steps", type=int, default=160, help="most steps measured (row_parallel w4: 157 an image)")
    parser.add_argument("--size", type=int, default=512, help="square image side in pixels (16 a token)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.streams < 1 or args.steps < 1 or args.window < 1 or args.lane_rows < 0:
        parser.error("--streams, --steps and --window must be positive and --lane-rows not negative")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if args.preview else "cpu")
    if args.preview and not torch.cuda.is_available():
        raise SystemExit("--preview needs a CUDA device")
    root = write_ar_only_root(Path(tempfile.mkdtemp()) / "ar", preview=args.preview, weights=not args.preview)
    loaded = load_ar(root, device=device, dtype=torch.bfloat16 if args.preview else torch.float32,
                     random_weights=args.preview)
    with torch.inference_mode():
        result = measure(loaded, device, args.mode, args.window, args.streams, args.lane_rows, args.steps, args.size)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
