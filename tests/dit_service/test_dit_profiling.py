"""The DiT engine's profiler switch: a trace of the busy period with its stages when on; nothing when off."""

from __future__ import annotations

import time

import torch

from dit_service.engine import DiTEngine, RenderDone, RenderFailed
from protos.knobs import FAMILIES
from servicekit.profiling import BusyProfiler, trace_event_names

HIDDEN = 64


def render(engine, request_id):
    g = torch.Generator().manual_seed(0)
    plan = engine.plan(request_id=request_id, width=64, height=64, n=1, seed=5, output_format="png",
                       output_compression=None, knobs={"num_inference_steps": 2}, hidden_size=HIDDEN,
                       dtype="float32", text_positions=4, image_positions=6, negative_positions=0)
    job = engine.submit(plan, torch.randn(10, HIDDEN, generator=g), torch.zeros(0, HIDDEN))
    while True:
        event = job.events.get(timeout=60)
        if isinstance(event, RenderFailed):
            raise event.error
        if isinstance(event, RenderDone):
            return


def test_profile_dir_set_writes_a_trace_with_the_dit_stages(pipeline, tmp_path):
    profiler = BusyProfiler("dit_service", tmp_path)
    engine = DiTEngine(pipeline, FAMILIES["mammothmoda2"], 4096, profiler=profiler)
    try:
        render(engine, "req-dit-1")
        deadline = time.monotonic() + 30
        while not profiler.traces() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.close()
    [path] = profiler.traces()
    assert list(tmp_path.iterdir()) == [path]
    assert path.name.startswith("dit_service-") and path.name.endswith("-req-dit-1.json")
    # the worker's stages; images are encoded beside it, on encoder threads (encode_ms, the dit.encode span)
    assert {"dit.denoise_step", "dit.vae_decode"} <= trace_event_names(path)


def test_profile_dir_unset_means_no_profiler_and_no_file(pipeline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = DiTEngine(pipeline, FAMILIES["mammothmoda2"], 4096)
    try:
        assert engine.profiler is None
        render(engine, "req-dit-2")
    finally:
        engine.close()
    assert not list(tmp_path.rglob("*.json"))
