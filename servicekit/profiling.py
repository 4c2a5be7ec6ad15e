"""Optional torch.profiler traces of an engine's busy periods.

An engine's worker thread calls ``busy(request_id)`` when it goes from idle to working and ``idle()`` when it
has nothing left to do. In between, a ``torch.profiler.profile`` records (CPU, plus CUDA when the model is on
CUDA; no shapes, no stacks), and ``idle()`` writes it as a Chrome trace
``<directory>/<service>-<UTC time>-<first request id>.json`` (open it in Perfetto or chrome://tracing). A
batched engine serves several requests in one busy period: the trace covers all of them and is named after the
first; with one request at a time it is exactly that request's stages. Stages are labelled with
``stage(name)`` (``torch.profiler.record_function``).

Off (no directory): engines hold no profiler at all and label stages through ``stage(None, name)``, which
returns one shared ``nullcontext`` (``record_function`` costs something even when nothing records).
At most ``max_traces`` traces are written per process, so a busy server cannot fill a disk. A trace is held in
memory until its busy period ends: meant for a few requests, not for a server that never goes idle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_OFF = contextlib.nullcontext()  # stateless and re-entrant: one instance serves every stage when off
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def stage(profiler: BusyProfiler | None, name: str) -> contextlib.AbstractContextManager:
    """A label for ``name`` in the trace being recorded; a shared no-op when ``profiler`` is None or idle."""
    return _OFF if profiler is None else profiler.stage(name)


class BusyProfiler:
    """Records one trace per busy period of an engine's worker thread (the only thread that may call it)."""

    def __init__(self, service: str, directory: Path | str, *, cuda: bool = False, max_traces: int = 10):
        if max_traces < 1:
            raise ValueError("max_traces must be at least 1")
        self.service = service
        self.directory = Path(directory)
        self.cuda = cuda
        self.max_traces = max_traces
        self.written: list[Path] = []
        self._profile: torch.profiler.profile | None = None
        self._first_request = ""
        self._started = ""
        self._lock = threading.Lock()  # guards ``written`` for readers on other threads

    @property
    def recording(self) -> bool:
        return self._profile is not None

    @property
    def exhausted(self) -> bool:
        return len(self.written) >= self.max_traces

    def stage(self, name: str) -> contextlib.AbstractContextManager:
        if self._profile is None:
            return _OFF
        return torch.profiler.record_function(name)

    def busy(self, request_id: str = "") -> None:
        """The engine starts working: begins a trace unless one is running or the trace cap is reached."""
        if self._profile is not None or self.exhausted:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        try:
            profile.start()
        except Exception:  # e.g. another profiler already runs in this process: serve on without a trace
            log.exception("%s: profiler did not start; this busy period is not traced", self.service)
            return
        self._profile = profile
        self._first_request = request_id
        self._started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())

    def idle(self) -> Path | None:
        """The engine has nothing left to do: stops the trace and writes it; returns its path."""
        profile, self._profile = self._profile, None
        if profile is None:
            return None
        try:
            profile.stop()
            path = self._path()
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")  # the trace appears under its name only when whole
            profile.export_chrome_trace(str(partial))
            partial.replace(path)
        except Exception:
            log.exception("%s: profiler trace could not be written to %s", self.service, self.directory)
            return None
        with self._lock:
            self.written.append(path)
            count = len(self.written)
        log.info("%s: profiler trace written to %s (%d of at most %d)", self.service, path, count, self.max_traces)
        if count >= self.max_traces:
            log.warning("%s: profiler trace cap (%d) reached; no more traces in this process", self.service, count)
        return path

    def traces(self) -> list[Path]:
        with self._lock:
            return list(self.written)

    def _path(self) -> Path:
        request = _UNSAFE.sub("_", self._first_request)[:80].strip("._") or "request"
        stem = f"{self.service}-{self._started}-{request}"
        path = self.directory / f"{stem}.json"
        n = 1
        while path.exists():
            n += 1
            path = self.directory / f"{stem}-{n}.json"
        return path


def trace_event_names(path: Path | str) -> set[str]:
    """The event names in a Chrome trace this module wrote (stage labels, operators, kernels)."""
    trace = json.loads(Path(path).read_text())
    return {event.get("name", "") for event in (trace["traceEvents"] if isinstance(trace, dict) else trace)}


def make_profiler(
    service: str, directory: Path | None, device: torch.device | str, max_traces: int = 10
) -> BusyProfiler | None:
    """The profiler a setting asks for: None (off, nothing allocated) when ``directory`` is None."""
    if directory is None:
        return None
    profiler = BusyProfiler(service, directory, cuda=torch.device(device).type == "cuda", max_traces=max_traces)
    log.info(
        "%s: profiling busy periods into %s (CPU%s, at most %d traces)",
        service, profiler.directory, " + CUDA" if profiler.cuda else "", max_traces,
    )
    return profiler
