"""The AR engine's profiler switch: a trace of the busy period with its stages when on; nothing when off."""

from __future__ import annotations

import time

import torch

from ar_service import events
from ar_service.engine import AREngine
from protos.knobs import FAMILIES
from servicekit.checkpoint import open_checkpoint
from servicekit.profiling import BusyProfiler, trace_event_names


class Session:
    def __init__(self, header, on_event):
        self.header, self.on_event = header, on_event

    def send_condition(self, kind, offset, hidden):
        pass

    def finish(self):
        self.on_event(events.RenderDone(self.header.index, {}))

    def cancel(self):
        pass


class Renderer:
    """Records whether a torch profiler was running while the worker opened a render."""

    def __init__(self):
        self.profiler_running: list[bool] = []

    def open(self, header, on_event, timeout=None):
        self.profiler_running.append(torch.autograd._profiler_enabled())
        return Session(header, on_event)


def run_one(engine, request_id):
    job = engine.submit(engine.plan(request_id=request_id, prompt="a red cube", negative_prompt="blurry",
                                    width=64, height=64, seed=3))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        event = job.events.get(timeout=60)
        if isinstance(event, events.JobFailed):
            raise AssertionError(event.error)
        if isinstance(event, events.JobDone):
            return
    raise AssertionError("job did not finish")


def test_profile_dir_set_writes_a_trace_with_the_ar_stages(tiny_ar, tiny_root, tmp_path):
    checkpoint = open_checkpoint(tiny_root)
    profiler = BusyProfiler("ar_service", tmp_path)
    renderer = Renderer()
    engine = AREngine(tiny_ar, checkpoint, FAMILIES[checkpoint.family], renderer, profiler=profiler)
    try:
        run_one(engine, "req-ar-1")
        deadline = time.monotonic() + 30
        while not profiler.traces() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.close()
    [path] = profiler.traces()
    assert list(tmp_path.iterdir()) == [path]
    assert path.name.startswith("ar_service-") and path.name.endswith("-req-ar-1.json")
    assert {"ar.prefill", "ar.decode_step", "ar.sample"} <= trace_event_names(path)
    assert renderer.profiler_running == [True]


def test_profile_dir_unset_means_no_profiler_and_no_file(tiny_ar, tiny_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = open_checkpoint(tiny_root)
    renderer = Renderer()
    engine = AREngine(tiny_ar, checkpoint, FAMILIES[checkpoint.family], renderer)
    try:
        assert engine.profiler is None
        run_one(engine, "req-ar-2")
    finally:
        engine.close()
    assert renderer.profiler_running == [False]
    assert not list(tmp_path.rglob("*.json"))
