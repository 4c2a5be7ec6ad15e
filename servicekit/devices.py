"""Device and dtype choice shared by the two model services ("auto" = CUDA in bf16 when present), and timing work on a device."""

from __future__ import annotations

import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"device {name!r} asked for, but CUDA is not available here")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class DeviceTimer:
    """How long the work issued between ``DeviceTimer(device)`` and ``stop()`` took on the device, read later by
    ``seconds()`` without making the host wait in between: CUDA events around it (the device's clock, so time the device
    spent waiting for the host to issue it counts too), or the host's clock on a CPU, where work runs as it is issued."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._started = time.perf_counter()
        self._seconds: float | None = None

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._seconds = time.perf_counter() - self._started

    def seconds(self) -> float:
        """Waits until the timed work is done (CUDA), then returns its duration."""
        if self._seconds is None:
            self._end.synchronize()
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds
