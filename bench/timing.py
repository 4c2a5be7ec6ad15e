"""Wall time of work queued on a device: the device synchronised around each call, so the time is the work's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], T], device: torch.device, repeats: int) -> tuple[float, T]:
    """(the median wall time of ``repeats`` calls of ``fn`` after one untimed call, in ms; the last call's result).
    The median, not the mean: an eager call's host-side launches make single calls noisy."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        sync(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), result


def queued_mean_ms(fn: Callable[[], object], repeats: int = 30, warmups: int = 5) -> float:
    """The mean CUDA time of ``repeats`` calls of ``fn`` queued back to back (CUDA events around them, after
    ``warmups`` untimed calls): for kernels short enough that a synchronisation per call would be part of the time."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats
