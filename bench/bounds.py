"""The machine's physical bounds: device copy bandwidth and bf16 matmul rate, measured so a peer can trust them.

``python -m bench.bounds --out bounds.json`` (needs torch alone); the harness measures the same before it starts
the services. Method:

- Each probe (one matmul shape, or one copy size) runs back to back in windows of about ``window_s``, the device
  synchronised only at a window's end; a window's rate is the work of its runs over its wall time. Warm-up
  lasts at least ``min_warm_s`` and until the last ``agree`` windows agree within ``tolerance``: an idle GPU
  ramps its clocks over a second or more (an H200 read 655-671 TFLOP/s after 0.3 s of warm-up, 780-800 after a
  longer one). Then ``windows`` windows are timed; the probe's figure is the best of them, with their median.
- The bound is the best probe: matmuls of several shapes (bf16, random data: zeros run faster and are not what a
  model multiplies), 2 m k n FLOPs each; copies of several sizes, all far larger than the L2 cache.
- Copy bytes are counted as read + written: ``dst.copy_(src)`` of N bytes moves 2 N bytes through memory, which
  is how the datasheet's memory bandwidth counts traffic. One AR decode token reads every weight it touches
  once, so weight bytes / this bandwidth is the least time it can take.
- Beside the figures: the card's datasheet peaks where the card is known (``bench.datasheet``), and its clocks,
  power and temperature from ``nvidia-smi`` when that answers (idle before the probes, and under load after
  each probe), so a reader can see whether the clocks were up.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import datasheet
from bench.report import emit

MIB = 1024**2
GIB = 1024**3
GPU_MATMUL_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192))  # (m, k, n)
CPU_MATMUL_SHAPES = ((512, 512, 512), (1024, 1024, 1024))
GPU_COPY_BYTES = (256 * MIB, GIB, 4 * GIB)
CPU_COPY_BYTES = (64 * MIB, 256 * MIB)

# What nvidia-smi is asked; every field has been in its --query-gpu list for many driver releases.
SMI_FIELDS = ("name", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw", "power.limit",
              "temperature.gpu", "pstate")


# -- warm up until steady, then time -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """How long to warm up and how much to time (see the module's docstring)."""

    min_warm_s: float = 2.0  # least warm-up per probe
    window_s: float = 0.2  # the work in one window, in seconds
    tolerance: float = 0.015  # the last `agree` warm-up windows' rates within 1.5% of each other
    agree: int = 3
    windows: int = 5  # timed windows after warm-up
    max_warm_s: float = 30.0  # give up waiting for agreement (the figure is then marked not stable)

    def __post_init__(self) -> None:
        if self.windows < 1 or self.agree < 1 or self.window_s <= 0 or self.tolerance < 0:
            raise ValueError(f"windows and agree must be at least 1, window_s above 0, tolerance not negative; got "
                             f"windows={self.windows}, agree={self.agree}, window_s={self.window_s}, "
                             f"tolerance={self.tolerance}")


@dataclass
class Steady:
    """One probe's timing: ``rate`` (work units per second) is the best timed window."""

    rate: float
    median: float
    windows: list[float]  # the timed windows' rates
    warm_s: float  # how long the warm-up ran
    warm_windows: list[float]  # the warm-up windows' rates, in order: the clock ramp, for the record
    stable: bool  # False: the warm-up reached max_warm_s before its windows agreed
    runs_per_window: int


def _window_rate(run: Callable[[], object], runs: int, work: float, sync: Callable[[], None],
                 clock: Callable[[], float]) -> tuple[float, float]:
    """(rate, seconds) of ``runs`` calls of ``run`` back to back, the device synchronised at the end only."""
    started = clock()
    for _ in range(runs):
        run()
    sync()
    elapsed = clock() - started
    return (runs * work / elapsed if elapsed > 0 else math.inf), elapsed


def _agree(rates: list[float], tolerance: float) -> bool:
    return min(rates) > 0 and max(rates) / min(rates) - 1 <= tolerance


def steady_rate(run: Callable[[], object], work: float, sync: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.perf_counter, settings: Settings = Settings()) -> Steady:
    """``run`` (``work`` units each) back to back in windows of about ``settings.window_s``: warm-up until at
    least ``min_warm_s`` have passed and the last ``agree`` windows' rates lie within ``tolerance`` of each other
    (or ``max_warm_s`` have passed: ``stable`` is then False), then ``windows`` timed windows. ``sync`` waits for
    the device and ``clock`` reads seconds: parameters, so that a made-up device can drive the loop."""
    runs = 1
    warm_rates: list[float] = []
    started = clock()
    while True:
        rate, elapsed = _window_rate(run, runs, work, sync, clock)
        warm_rates.append(rate)
        runs = max(1, round(settings.window_s * runs / elapsed)) if elapsed > 0 else runs * 2
        warm_s = clock() - started
        stable = len(warm_rates) >= settings.agree and _agree(warm_rates[-settings.agree:], settings.tolerance)
        if (warm_s >= settings.min_warm_s and stable) or warm_s >= settings.max_warm_s:
            break
    timed = [_window_rate(run, runs, work, sync, clock)[0] for _ in range(settings.windows)]
    return Steady(rate=max(timed), median=statistics.median(timed), windows=timed, warm_s=warm_s,
                  warm_windows=warm_rates, stable=stable, runs_per_window=runs)


# -- the probes ------------------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """One thing to time: ``run`` does ``work`` units (FLOPs or bytes moved) per call; ``size`` says which."""

    run: Callable[[], object]
    work: float
    size: dict


def matmul_probe(device: torch.device, shape: tuple[int, int, int], dtype: torch.dtype = torch.bfloat16) -> Probe:
    """``(m x k) @ (k x n)`` on random data into a preallocated output: 2 m k n FLOPs."""
    m, k, n = shape
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=generator, device=device, dtype=dtype)
    b = torch.randn(k, n, generator=generator, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return Probe(lambda: torch.matmul(a, b, out=out), 2.0 * m * k * n, {"shape": [m, k, n]})


def copy_probe(device: torch.device, nbytes: int) -> Probe:
    """``dst.copy_(src)`` of ``nbytes`` of bf16: counted as 2 x ``nbytes`` moved (each byte read once, written
    once)."""
    numel = max(1, nbytes // 2)
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return Probe(lambda: dst.copy_(src), 2.0 * numel * 2, {"bytes": numel * 2})


def best_of(results: list[dict], key: str) -> dict:
    """The result with the highest ``key``: the bound is what the best size reached."""
    if not results:
        raise ValueError("no sizes were measured")
    return max(results, key=lambda result: result[key])


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _time_probes(device: torch.device, probes: list[Callable[[], Probe]], unit_scale: float, key: str,
                 settings: Settings) -> list[dict]:
    """Each probe built, timed until steady, read by nvidia-smi under load (while a window's work is queued) and
    freed before the next is built. Rates are divided by ``unit_scale`` and stored under ``key``."""
    sync = _sync_for(device)
    results = []
    for make in probes:
        probe = make()
        timing = steady_rate(probe.run, probe.work, sync, settings=settings)
        for _ in range(timing.runs_per_window):  # the device kept busy while nvidia-smi reads its clocks
            probe.run()
        under_load = gpu_state(device)
        sync()
        results.append({
            **probe.size, key: timing.rate / unit_scale, f"median_{key}": timing.median / unit_scale,
            f"windows_{key}": [rate / unit_scale for rate in timing.windows],
            f"warm_windows_{key}": [rate / unit_scale for rate in timing.warm_windows],
            "warm_s": timing.warm_s, "stable": timing.stable, "runs_per_window": timing.runs_per_window,
            "gpu_under_load": under_load,
        })
        del probe
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def matmul_rate(device: str | torch.device, shapes: tuple | list | None = None, dtype: torch.dtype = torch.bfloat16,
                settings: Settings = Settings()) -> dict:
    """The best TFLOP/s over ``shapes`` ((m, k, n) each; default: three bf16 shapes up to 16384 x 8192 x 8192 on
    a GPU), each warmed up until steady."""
    device = torch.device(device)
    shapes = shapes or (GPU_MATMUL_SHAPES if device.type == "cuda" else CPU_MATMUL_SHAPES)
    sizes = _time_probes(device, [lambda s=tuple(s): matmul_probe(device, s, dtype) for s in shapes], 1e12,
                         "tflop_per_s", settings)
    best = best_of(sizes, "tflop_per_s")
    return {"tflop_per_s": best["tflop_per_s"], "shape": best["shape"], "dtype": str(dtype).removeprefix("torch."),
            "counted": "2 m k n FLOPs per (m x k) @ (k x n) product, random data", "sizes": sizes}


def copy_bandwidth(device: str | torch.device, sizes: tuple | list | None = None, settings: Settings = Settings()) -> dict:
    """The best GB/s (10^9 bytes, read + written) over copies of ``sizes`` bytes (default 256 MiB, 1 GiB and
    4 GiB on a GPU), each warmed up until steady."""
    device = torch.device(device)
    sizes = sizes or (GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    results = _time_probes(device, [lambda n=int(n): copy_probe(device, n) for n in sizes], 1e9, "gb_per_s", settings)
    best = best_of(results, "gb_per_s")
    return {"gb_per_s": best["gb_per_s"], "bytes": best["bytes"],
            "counted": "bytes read + bytes written: 2 x the tensor's size per copy", "sizes": results}


# -- the card: name, datasheet, clocks -------------------------------------------------------------------------------


def parse_smi(line: str, fields: tuple[str, ...] = SMI_FIELDS) -> dict:
    """One ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` line -> {field: value}; numbers as
    floats, "[N/A]" and the like as None."""
    values = [value.strip() for value in line.split(",")]
    if len(values) != len(fields):
        raise ValueError(f"expected {len(fields)} comma-separated values from nvidia-smi; got {line!r}")
    parsed: dict = {}
    for field, value in zip(fields, values, strict=True):
        if value.startswith("[") or value in ("", "N/A"):
            parsed[field] = None
            continue
        try:
            parsed[field] = float(value)
        except ValueError:
            parsed[field] = value
    return parsed


def gpu_state(device: torch.device) -> dict | None:
    """The card's clocks (MHz), power (W), temperature and performance state from nvidia-smi, or None where it
    is absent or does not answer (a CPU, a container without it). The card is named by its UUID, which holds
    whatever CUDA_VISIBLE_DEVICES says, then by its index."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    for target in ([f"GPU-{uuid}"] if uuid is not None else []) + [str(index)]:
        try:
            answer = subprocess.run(["nvidia-smi", f"--id={target}", f"--query-gpu={','.join(SMI_FIELDS)}",
                                     "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True)
            return parse_smi(answer.stdout.strip().splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            continue
    return None


def measure(device: str | torch.device, matmul_shapes: tuple | list | None = None,
            copy_sizes: tuple | list | None = None, settings: Settings = Settings()) -> dict:
    """Both bounds (the matmul rate, then the copy bandwidth), with the card's datasheet peaks and nvidia-smi's
    readings beside them. The keys ``copy.gb_per_s`` and ``matmul.tflop_per_s`` are the bounds. Matmuls are
    bf16 on a GPU and float32 on a CPU (the dtype the services use there)."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else None
    idle = gpu_state(device)
    matmul = matmul_rate(device, matmul_shapes, torch.bfloat16 if gpu else torch.float32, settings=settings)
    copy = copy_bandwidth(device, copy_sizes, settings=settings)
    peaks = datasheet.peaks(name)
    if peaks:
        matmul["datasheet_tflop_per_s"] = peaks["bf16_dense_tflop_per_s"]
        matmul["fraction_of_datasheet"] = matmul["tflop_per_s"] / peaks["bf16_dense_tflop_per_s"]
        copy["datasheet_gb_per_s"] = peaks["memory_gb_per_s"]
        copy["fraction_of_datasheet"] = copy["gb_per_s"] / peaks["memory_gb_per_s"]
    if gpu:
        torch.cuda.empty_cache()
    return {
        "device": str(device), "device_name": name, "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "method": {**asdict(settings), "figure": "the best timed window of the best size, after warm-up until steady"},
        "matmul": matmul, "copy": copy, "datasheet": peaks, "gpu_idle": idle,
    }


def summary(measured: dict) -> str:
    """One line: both bounds, and the datasheet's figures where known."""
    matmul, copy = measured["matmul"], measured["copy"]
    parts = [f"matmul {matmul['tflop_per_s']:.4g} TFLOP/s ({matmul['dtype']} {'x'.join(map(str, matmul['shape']))})",
             f"copy {copy['gb_per_s']:.4g} GB/s (read + write, {copy['bytes'] / MIB:.0f} MiB)"]
    if measured.get("datasheet"):
        peaks = measured["datasheet"]
        parts.append(f"datasheet ({peaks['source']}): {peaks['bf16_dense_tflop_per_s']:g} TFLOP/s dense bf16, "
                     f"{peaks['memory_gb_per_s']:g} GB/s")
    return f"[bounds] {measured.get('device_name') or measured['device']}: " + "; ".join(parts)


# -- command line ----------------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``8192,16384x8192x8192`` -> [(8192, 8192, 8192), (16384, 8192, 8192)]: N is N x N x N, MxKxN is
    (m x k) @ (k x n)."""
    shapes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            dims = [int(d) for d in part.lower().split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (1, 3) or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"expected N or MxKxN, comma-separated; got {text!r}")
        shapes.append((dims[0],) * 3 if len(dims) == 1 else (dims[0], dims[1], dims[2]))
    if not shapes:
        raise argparse.ArgumentTypeError(f"expected N or MxKxN, comma-separated; got {text!r}")
    return shapes


def parse_mib(text: str) -> list[int]:
    """``256,1024`` (MiB) -> sizes in bytes."""
    try:
        sizes = [int(float(p) * MIB) for p in text.split(",") if p.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected sizes in MiB, comma-separated; got {text!r}")
    return sizes


def add_settings_options(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The warm-up and timing options (``Settings``), for this module's command line and the harness's
    (``prefix="bounds-"``)."""
    default = Settings()
    parser.add_argument(f"--{prefix}warm-s", type=float, default=default.min_warm_s,
                        help=f"least warm-up per size in seconds; it goes on until the rate is steady "
                             f"(default {default.min_warm_s:g})")
    parser.add_argument(f"--{prefix}max-warm-s", type=float, default=default.max_warm_s,
                        help=f"most warm-up per size; past it the figure is marked not stable (default {default.max_warm_s:g})")
    parser.add_argument(f"--{prefix}tolerance", type=float, default=default.tolerance,
                        help=f"how closely the last {default.agree} warm-up windows must agree "
                             f"(default {default.tolerance:g})")
    parser.add_argument(f"--{prefix}windows", type=int, default=default.windows,
                        help=f"timed windows per size after warm-up (default {default.windows})")


def settings_from(args: argparse.Namespace, prefix: str = "") -> Settings:
    """``Settings`` from the options ``add_settings_options`` added."""
    attr = prefix.replace("-", "_")
    return Settings(min_warm_s=getattr(args, f"{attr}warm_s"), max_warm_s=getattr(args, f"{attr}max_warm_s"),
                    tolerance=getattr(args, f"{attr}tolerance"), windows=getattr(args, f"{attr}windows"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bounds", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--matmul", type=parse_shapes, default=None,
                        help="shapes, N or MxKxN, comma-separated (default 4096,8192,16384x8192x8192 on a GPU)")
    parser.add_argument("--copy-mib", type=parse_mib, default=None,
                        help="copy sizes in MiB, comma-separated (default 256,1024,4096 on a GPU)")
    add_settings_options(parser)
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    measured = measure(args.device, args.matmul, args.copy_mib, settings)
    command = argv if argv is not None else sys.argv[1:]
    measured["command"] = "python -m bench.bounds " + shlex.join(command)
    emit(measured, args.out, heading=summary(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
