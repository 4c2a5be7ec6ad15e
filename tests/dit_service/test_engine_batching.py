"""The DiT engine without a socket: admission bound, FIFO batching, cancellation, deterministic mode, encodes
beside the step loop."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dit_service.engine as engine_module
from dit_service.engine import DiTEngine, FinishedImage, Progress, QueueFull, RenderDone, RenderFailed
from dit_service.model.sampler import DenoiseCancelled
from protos.knobs import FAMILIES

HIDDEN = 64


def make_engine(pipeline, **kwargs) -> DiTEngine:
    return DiTEngine(pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096, **kwargs)


def submit(engine, seed, steps=3, guidance=4.0, n=1, cond_seed=0, size=64, admitted=False):
    g = torch.Generator().manual_seed(cond_seed)
    text, image = torch.randn(4, HIDDEN, generator=g), torch.randn(6, HIDDEN, generator=g)
    plan = engine.plan(request_id=f"r{seed}", width=size, height=size, n=n, seed=seed, output_format="png",
                       output_compression=None, knobs={"num_inference_steps": steps, "text_guidance_scale": guidance},
                       hidden_size=HIDDEN, dtype="float32", text_positions=4, image_positions=6, negative_positions=0)
    return engine.submit(plan, torch.cat([text, image]), torch.zeros(0, HIDDEN), admitted=admitted)


def submit_admitted(engine, seed, **kwargs):
    """A render whose header took its queue slot earlier (``engine.admit()``), as dit_service's Render does."""
    return submit(engine, seed, admitted=True, **kwargs)


def collect(job, timeout=60):
    images, progress = {}, []
    while True:
        event = job.events.get(timeout=timeout)
        if isinstance(event, RenderFailed):
            raise event.error
        if isinstance(event, Progress):
            progress.append(event.step)
        if isinstance(event, FinishedImage):
            images[event.index] = event.data
        if isinstance(event, RenderDone):
            return images, progress, event


def test_batched_and_deterministic_engines_give_the_same_images(pipeline):
    batched = make_engine(pipeline, max_batch_size=4)
    deterministic = make_engine(pipeline, max_batch_size=4, deterministic=True)
    try:
        specs = [dict(seed=1, steps=4, n=2), dict(seed=5, steps=3, guidance=1.0, cond_seed=1),
                 dict(seed=9, steps=5, guidance=6.0, cond_seed=2)]
        jobs = [submit(batched, **spec) for spec in specs]
        results = [collect(job) for job in jobs]
        for spec, (images, _progress, done) in zip(specs, results, strict=True):
            assert len(images) == spec.get("n", 1)
            assert done.timings["transformer_calls"] > 0 and done.timings["denoise_ms"] > 0
        assert batched.status()["largest_batch"] > 1
        assert batched.status()["completed_total"] == 3
        for spec, (images, _, _) in zip(specs, results, strict=True):
            again, _, _ = collect(submit(deterministic, **spec))
            assert again == images
    finally:
        batched.close()
        deterministic.close()


def test_admission_is_bounded_and_slots_come_back(pipeline):
    engine = make_engine(pipeline, max_batch_size=1, max_queued_renders=2)
    try:
        engine.admit()
        engine.admit()
        with pytest.raises(QueueFull) as caught:
            engine.admit()
        assert caught.value.retry_after_s >= 1
        engine.withdraw()
        engine.withdraw(cancelled=True)
        status = engine.status()
        assert (status["queued"], status["admitted_total"], status["rejected_total"], status["cancelled_total"]) == (0, 2, 1, 1)
        assert collect(submit(engine, seed=3))[0]
    finally:
        engine.close()


def test_cancelled_render_leaves_within_a_step(pipeline):
    engine = make_engine(pipeline, max_batch_size=2)
    try:
        doomed = submit(engine, seed=1, steps=200)
        mate = submit(engine, seed=2, steps=6)
        first = doomed.events.get(timeout=60)
        assert isinstance(first, Progress)
        doomed.cancel()
        last_step = first.step
        while True:
            event = doomed.events.get(timeout=60)
            if isinstance(event, RenderFailed):
                assert isinstance(event.error, DenoiseCancelled)
                break
            last_step = event.step
        assert last_step < 200  # it left the batch long before its steps ran out
        images, _, _ = collect(mate)
        solo = make_engine(pipeline)
        try:
            assert collect(submit(solo, seed=2, steps=6))[0] == images
        finally:
            solo.close()
        status = engine.status()
        assert status["cancelled_total"] == 1 and status["running"] == 0
    finally:
        engine.close()


# -- the batch window: renders that arrive apart under load start and finish together --------------------------------


def steps_at_batch(engine) -> tuple[float, float]:
    """(denoise steps run, images in them) since the engine started, from its batch-size histogram."""
    registry = engine.metrics.registry
    return registry.get_sample_value("ardit_dit_batch_size_count"), registry.get_sample_value("ardit_dit_batch_size_sum")


def test_renders_admitted_together_share_every_step_and_equal_their_solo_images(pipeline):
    engine = make_engine(pipeline, max_batch_size=4, batch_window_s=120.0)  # ends when the last one arrives
    solo = make_engine(pipeline)
    try:
        specs = [dict(seed=21, steps=4), dict(seed=22, steps=4, cond_seed=1), dict(seed=23, steps=4, guidance=1.0)]
        for _ in specs:
            engine.admit()  # three headers in: their conditions are on the way
        jobs = []
        for spec in specs:  # the conditions complete one after the other
            jobs.append(submit_admitted(engine, **spec))
        results = [collect(job) for job in jobs]
        assert steps_at_batch(engine) == (4, 12)  # 4 steps, every one with all three images
        status = engine.status()
        assert status["largest_batch"] == 3 and status["batched_steps_total"] == 4
        for spec, (images, _, _) in zip(specs, results, strict=True):
            assert collect(submit(solo, **spec))[0] == images
    finally:
        engine.close()
        solo.close()


def test_a_lone_render_never_waits_for_the_window(pipeline):
    engine = make_engine(pipeline, batch_window_s=120.0)
    try:
        images, _, _ = collect(submit(engine, seed=3))
        assert images and engine.counters["windows"] == 0
        assert engine.metrics.registry.get_sample_value("ardit_dit_batch_window_seconds_count") == 0
    finally:
        engine.close()


def test_a_render_waiting_in_the_window_can_be_cancelled(pipeline):
    engine = make_engine(pipeline, max_batch_size=4, batch_window_s=600.0)
    try:
        engine.admit()
        engine.admit()  # a second render's condition is still arriving: the first one waits for it
        job = submit_admitted(engine, seed=1)
        job.cancel()
        event = job.events.get(timeout=60)  # long before the window would end
        assert isinstance(event, RenderFailed) and isinstance(event.error, DenoiseCancelled)
        engine.withdraw(cancelled=True)
        assert collect(submit(engine, seed=2))[0]  # the engine serves on
    finally:
        engine.close()


def test_a_render_of_another_size_behind_the_head_ends_the_window(pipeline):
    engine = make_engine(pipeline, max_batch_size=4, batch_window_s=600.0)
    try:
        for _ in range(3):
            engine.admit()
        first = submit_admitted(engine, seed=1)
        other = submit_admitted(engine, seed=2, size=32)  # it could not join the head's batch: no point waiting
        assert collect(first)[0]
        engine.withdraw()  # the third render's stream failed: nothing more is on the way, the window ends
        assert collect(other)[0]
    finally:
        engine.close()


def test_the_png_level_setting_changes_the_file_not_the_picture(pipeline):
    """dit_service's png_compress_level: the same render at zlib level 9 is a smaller file than at level 0, and both
    decode to the same pixels (a user choosing bytes over encode time loses nothing else)."""
    import io

    import numpy as np
    from PIL import Image

    from dit_service.settings import DiTSettings

    files = {}
    for level in (0, 9):
        engine = make_engine(pipeline, png_compress_level=level)
        try:
            images, _, _ = collect(submit(engine, seed=3, steps=2))
        finally:
            engine.close()
        files[level] = images[0]
    assert len(files[9]) < len(files[0])
    pixels = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in files.values()]
    assert np.array_equal(pixels[0], pixels[1])
    assert DiTSettings().png_compress_level == 1  # the fastest encode by default
    with pytest.raises(ValueError, match="png_compress_level"):
        DiTSettings(png_compress_level=10)


def test_a_slow_encode_does_not_hold_up_the_other_renders(pipeline, monkeypatch):
    """Render A's PNG encode is held until B has finished: B's steps run meanwhile, because finished images are
    encoded beside the worker, not in its step loop. Then A comes out whole."""
    entered, release = threading.Event(), threading.Event()
    real = engine_module.encode_image
    calls = []

    def encode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # A's image
            entered.set()
            assert release.wait(60), "the test never released A's encode"
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "encode_image", encode)
    engine = make_engine(pipeline, max_batch_size=2)
    try:
        a = submit(engine, seed=1, steps=2)
        assert entered.wait(60)
        b_images, b_progress, _ = collect(submit(engine, seed=2, steps=4, cond_seed=1), timeout=30)
        assert list(b_images) == [0] and b_progress[-1] == 4
        assert not any(isinstance(e, (FinishedImage, RenderDone)) for e in list(a.events.queue))  # A still held
        release.set()
        a_images, _, done = collect(a)
        assert list(a_images) == [0] and a_images[0].startswith(b"\x89PNG")
        assert done.timings["encode_ms"] > 0
    finally:
        release.set()
        engine.close()


def test_a_failed_encode_fails_its_render_and_the_engine_goes_on(pipeline, monkeypatch):
    real = engine_module.encode_image
    calls = []

    def encode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full while writing the PNG")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "encode_image", encode)
    engine = make_engine(pipeline, max_batch_size=2)
    try:
        with pytest.raises(OSError, match="disk full"):
            collect(submit(engine, seed=1, steps=2))
        images, _, _ = collect(submit(engine, seed=2, steps=2))
        assert list(images) == [0]
    finally:
        engine.close()


def test_a_closed_engine_delivers_what_it_admitted_then_its_threads_end(pipeline):
    before = set(threading.enumerate())
    engine = make_engine(pipeline, max_batch_size=2)
    jobs = [submit(engine, seed=s, steps=2, n=2) for s in (1, 2)]
    engine.close()
    for job in jobs:
        images, _, _ = collect(job)
        assert sorted(images) == [0, 1]
    started = [t for t in threading.enumerate() if t not in before]  # the worker and its encoders still running
    for thread in started:
        thread.join(30)
    assert not [t.name for t in started if t.is_alive()]


def test_every_step_is_reported_and_timed_once(pipeline):
    """Steps are issued ahead of the host's bookkeeping: each image still reports each of its steps once, in order,
    every step it ran counts in the metrics, and so does the last step of a render that left mid-way."""
    engine = make_engine(pipeline, max_batch_size=2)
    sample = engine.metrics.registry.get_sample_value
    try:
        jobs = [submit(engine, seed=1, steps=5), submit(engine, seed=2, steps=3, cond_seed=1)]
        results = [collect(job) for job in jobs]
        assert [progress for _, progress, _ in results] == [[1, 2, 3, 4, 5], [1, 2, 3]]
        assert all(done.timings["denoise_ms"] > 0 for _, _, done in results)
        assert sample("ardit_dit_batch_size_sum") == 5 + 3  # image-steps, however the two were batched
        assert sample("ardit_dit_step_seconds_count") == sample("ardit_dit_batch_size_count")
        doomed = submit(engine, seed=3, steps=200)
        reported = 0
        while isinstance(event := doomed.events.get(timeout=60), Progress):
            reported += 1
            if reported == 2:
                doomed.cancel()
        assert isinstance(event, RenderFailed) and isinstance(event.error, DenoiseCancelled)
        deadline = time.monotonic() + 60
        while engine.status()["running"] or engine._in_flight is not None:  # the worker settles the last step
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ran = sample("ardit_dit_batch_size_sum") - 8
        assert reported <= ran <= reported + 2  # a step issued before the cancel was seen may not be reported
        assert sample("ardit_dit_step_seconds_count") == sample("ardit_dit_batch_size_count")
    finally:
        engine.close()
