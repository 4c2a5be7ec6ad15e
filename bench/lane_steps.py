"""Where a saturated fast-decode step goes, host against device: N guided streams of one decoding mode decode
together in one slot decoder (the engine's token loop without the engine), and each step's wall time is split into
the forward's time and the host's rest (each row's inputs, the passes of lanes, each stream's bookkeeping).

    python -m bench.lane_steps [--preview] [--mode row_parallel] [--window 4] [--streams 16] [--lane-rows 0]
        [--lane-attention auto|gather|triton|triton-slots] [--steps 160] [--size 512] [--profile N] [--out FILE]

Why: at 16 clients on an H100 a row-parallel step of about 206 rows took 74 ms of the engine's wall time, where the
device profile gives a step about 0.08 ms a row (bench/results/h100/saturation-wide/NOTES.md). This says how much of
such a step is the host's. The tiny model (the default) runs on the CPU, where the forward's time is its wall time;
``--preview`` builds the Preview shapes with random bf16 weights on CUDA (torch kernels, compiled, every graph
captured first), where it is the device time of each step's upload and replay (both: ``StaticDecoder.device_timing``).
``--profile N`` then decodes N more steps of the same decoder under ``torch.profiler``, untimed, to say which kernels
(on the CPU, which operators) a wide step of lanes spends its device time in: the top 25 by self device time (self CPU
time on the CPU, or where no kernel of the graph replays is attributed), each with its calls, ms a step and share.
``--lane-attention triton-slots`` reads each slot once for all of its rows in a step, to set against triton's read
per row (auto on CUDA) on one card. Prints one JSON object (and writes it to --out).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ar_service.conditions import prompt_ids_for
from ar_service.decoding import SEQUENTIAL, Decoding
from ar_service.decoding.decoders import SlotDecoder
from ar_service.decoding.stream import DecodeStream
from ar_service.model.loading import load_ar
from ar_service.model.static_decode import DIRECT_LANE_ATTENTION, StaticDecoder, lane_rows_for
from ar_service.model.tiny import write_ar_only_root
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from bench.report import emit

#: The released guidance scale of the AR (``generate_t2i``'s default, ar_service's ``ar_cfg_scale``).
GUIDANCE = 6.0
#: Pixels a visual token covers at the released 32x32 grid of a 512x512 image.
PIXELS_PER_TOKEN = 16
#: Operators or kernels a profile lists, and the longest name it keeps of each.
PROFILE_ENTRIES, PROFILE_NAME_CHARS = 25, 120


def measure(loaded, device: torch.device, mode: str, window: int, streams: int, lane_rows: int, steps: int,
            size: int, profile_steps: int = 0, lane_attention: str = "auto") -> dict:
    """Decodes ``streams`` guided images of ``mode`` together for up to ``steps`` steps; returns the split (and, for
    ``profile_steps``, the profile of that many more steps)."""
    grid = grid_for_size(size, size, PIXELS_PER_TOKEN)
    prompts = [prompt_ids_for(loaded.tokenizer, f"a photograph of object number {i} on a table", grid)
               for i in range(streams)]
    slots = 2 * streams
    max_positions = max(len(ids) for ids in prompts) + grid.decode_tokens + 2
    cuda = device.type == "cuda"
    static = StaticDecoder(loaded.model, slots, max_positions, compile=cuda, shared_slots=True,
                           lane_rows=lane_rows_for(lane_rows, slots, "torch"), lane_attention=lane_attention)
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
    started = time.perf_counter()
    running, taken, rows, tokens = decode_steps(decoder, running, steps)
    wall_ms = (time.perf_counter() - started) * 1000
    forward_ms = static.device_ms
    static.device_timing = False
    profiled = None
    if profile_steps:
        running, profiled = profile_decode(decoder, running, profile_steps, device)
    for stream in running:
        decoder.release(stream)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "mode": mode, "window": window if decoding else 0, "streams": streams, "slots": slots,
        "lane_rows": static.lane_rows, "lane_attention": static.lane_attention, "size": size, "grid": f"{grid.width}x{grid.height}",
        "steps": taken, "rows_per_step": round(rows / taken, 2), "tokens_per_step": round(tokens / taken, 2),
        "step_ms": round(wall_ms / taken, 3), "forward_ms": round(forward_ms / taken, 3),
        "host_ms": round((wall_ms - forward_ms) / taken, 3),
        "host_us_per_row": round((wall_ms - forward_ms) * 1000 / rows, 2),
    }
    if profiled is not None:
        result["profile"] = profiled
    return result


def decode_steps(decoder: SlotDecoder, running: list[DecodeStream], steps: int
                 ) -> tuple[list[DecodeStream], int, int, int]:
    """The token loop: up to ``steps`` steps of ``running`` in ``decoder``; returns the streams still running and the
    steps taken, rows fed and tokens advanced."""
    rows = tokens = taken = 0
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
    return running, taken, rows, tokens


def profile_decode(decoder: SlotDecoder, running: list[DecodeStream], steps: int, device: torch.device
                   ) -> tuple[list[DecodeStream], dict]:
    """Up to ``steps`` more steps of the token loop under ``torch.profiler``; returns the streams still running and
    the profile: the steps taken and the top operators or kernels by self device time (by self CPU time on the CPU,
    or where the profiler attributes no kernel, as it may not inside CUDA graph replays)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        running, taken, _, _ = decode_steps(decoder, running, steps)
        if cuda:
            torch.cuda.synchronize(device)
    events = profiler.key_averages()
    kernels = [(event, event.self_device_time_total) for event in events
               if event.device_type != torch.autograd.DeviceType.CPU and not event.is_user_annotation]
    device_us = sum(us for _, us in kernels)
    report: dict = {"steps": taken}
    if cuda:
        report["device_ms_per_step"] = round(device_us / 1000 / max(taken, 1), 4)
    if device_us > 0:
        report["sorted_by"], timed = "self_device_time", kernels
    else:
        report["sorted_by"] = "self_cpu_time"
        timed = [(event, event.self_cpu_time_total) for event in events
                 if event.device_type == torch.autograd.DeviceType.CPU]
    total_us = sum(us for _, us in timed)
    report["total_ms_per_step"] = round(total_us / 1000 / max(taken, 1), 4)
    top = sorted((pair for pair in timed if pair[1] > 0), key=lambda pair: pair[1], reverse=True)[:PROFILE_ENTRIES]
    report["entries"] = [{"name": event.key[:PROFILE_NAME_CHARS], "calls": event.count,
                          "self_ms_per_step": round(us / 1000 / max(taken, 1), 4), "share": _share(us, total_us)}
                         for event, us in top]
    return running, report


def _share(part: float, whole: float) -> float:
    """``part / whole`` rounded down to four significant digits: never 0 for a positive part, and shares never sum
    past 1."""
    share = part / whole
    scale = 10.0 ** (3 - math.floor(math.log10(share)))
    return math.floor(share * scale) / scale


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preview", action="store_true", help="Preview shapes, random bf16 weights, on CUDA")
    parser.add_argument("--mode", choices=[SEQUENTIAL, "speculative", "row_parallel"], default="row_parallel")
    parser.add_argument("--window", type=int, default=4, help="ar_decoding_window of the mode")
    parser.add_argument("--streams", type=int, default=16, help="guided images decoding together")
    parser.add_argument("--lane-rows", type=int, default=0, help="decode_lane_rows (0: auto)")
    parser.add_argument("--steps", type=int, default=160, help="most steps measured (row_parallel w4: 157 an image)")
    parser.add_argument("--size", type=int, default=512, help="square image side in pixels (16 a token)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N more steps after the measured ones (0: none)")
    parser.add_argument("--lane-attention", choices=("auto", "gather", *DIRECT_LANE_ATTENTION), default="auto",
                        help="how a step of lanes reads its rows' slots (StaticDecoder's lane_attention): triton once "
                        "a row, triton-slots once for a slot's rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.streams < 1 or args.steps < 1 or args.window < 1 or args.lane_rows < 0 or args.profile < 0:
        parser.error("--streams, --steps and --window must be positive and --lane-rows and --profile not negative")
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
        result = measure(loaded, device, args.mode, args.window, args.streams, args.lane_rows, args.steps, args.size,
                         args.profile, args.lane_attention)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
