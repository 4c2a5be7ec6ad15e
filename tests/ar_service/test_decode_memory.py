"""The fast decoder's memory: its arithmetic against the real allocation and a real step (tiny model, CPU), and the
engine sized to a device's memory: all the images asked for, fewer (a warning with the figures, and it still
serves), a refusal when not even one fits, and a decoder built again smaller when building it runs out of memory."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from pydantic import ValidationError
from torch.profiler import ProfilerActivity, profile

import ar_service.engine as engine_module
from ar_service import events
from ar_service.model import decode_memory
from ar_service.model.decode_memory import (
    DecodeMemoryError,
    DeviceMemory,
    decode_bytes_per_slot,
    decode_workspace_bytes,
    fit_batch,
    format_bytes,
    is_out_of_memory,
    step_workspace_bytes,
)
from ar_service.model.static_decode import StaticDecoder, lane_rows_for
from ar_service.sampling import SamplingParams
from ar_service.settings import ARSettings
from tests.ar_service.test_ar_batching import FakeRenderer, make_engine, wait_done

ROWS_PER_IMAGE = engine_module.ROWS_PER_IMAGE
HUGE = 1 << 50


# -- the arithmetic ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("slots", "max_positions"), [(1, 64), (4, 1200), (6, 333)])
def test_per_slot_bytes_are_what_the_static_decoder_allocates(tiny_ar, slots, max_positions):
    static = StaticDecoder(tiny_ar.model, slots=slots, max_positions=max_positions)
    per_slot = decode_bytes_per_slot(tiny_ar.config, max_positions, static.k.element_size())
    assert slots * per_slot == static.k.nbytes + static.v.nbytes


def _peak_bytes(run) -> int:
    """The most bytes that ``run()`` held at once on the CPU, from the profiler's allocation events."""
    with torch.inference_mode():
        run()  # first-use allocations out of the way
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    moves = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                   key=lambda e: e.start_ns())
    live = peak = 0
    for event in moves:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("slots", "max_positions", "lanes"), [(8, 1200, False), (8, 1200, True), (4, 2000, False)])
def test_the_step_workspace_estimate_bounds_what_a_step_allocates(tiny_ar, slots, max_positions, lanes):
    """A torch-kernel step over every slot at the end of the cache (the largest shape it captures), measured: the
    estimate is at least what the step held at once, and not more than twice it. ``lanes``: a step whose rows read
    their slots' caches through a gather (``step_lanes``)."""
    static = StaticDecoder(tiny_ar.model, slots=slots, max_positions=max_positions, shared_slots=lanes)
    start = tiny_ar.config.gen_vocab_start_index
    draw = ((start, start + 10), SamplingParams(1.0, 0, 1.0), 0, 0)
    inputs = (list(range(slots)), [start] * slots, [max_positions - 2] * slots, [draw] * slots)
    step = static.step_lanes if lanes else static.step
    measured = _peak_bytes(lambda: step(*inputs))
    estimate = step_workspace_bytes(tiny_ar.config, slots, max_positions, dtype_bytes=static.k.element_size(),
                                    shared_slots=lanes)
    assert measured > 0
    assert measured <= estimate <= 2 * measured, (measured, estimate)


def test_fit_batch_keeps_shrinks_or_refuses_with_the_figures():
    per_slot = 1000

    def workspace(rows: int) -> int:
        return 500 + 10 * rows

    def needed(images: int) -> int:
        return images * 2 * per_slot + workspace(images * 2)

    kept = fit_batch(8, 2, per_slot, workspace, needed(8))
    assert (kept.images, kept.needed, kept.shrunk) == (8, needed(8), False)
    shrunk = fit_batch(8, 2, per_slot, workspace, needed(5) + 1)
    assert (shrunk.images, shrunk.needed, shrunk.requested_needed, shrunk.available) == (5, needed(5), needed(8),
                                                                                          needed(5) + 1)
    assert shrunk.shrunk
    with pytest.raises(DecodeMemoryError) as refused:
        fit_batch(8, 2, per_slot, workspace, needed(1) - 1)
    assert (refused.value.needed, refused.value.available) == (needed(1), needed(1) - 1)
    assert format_bytes(needed(1)) in str(refused.value)


def test_the_budget_is_the_share_less_what_is_held_and_never_more_than_is_free():
    memory = DeviceMemory(total=80 << 30, free=60 << 30, held=20 << 30)
    assert memory.budget(0.5) == 20 << 30
    assert memory.budget(1.0) == 60 << 30  # 80 - 20 = 60, all free
    assert DeviceMemory(total=80 << 30, free=10 << 30, held=20 << 30).budget(0.9) == 10 << 30  # the DiT took the rest
    assert DeviceMemory(total=80 << 30, free=60 << 30, held=50 << 30).budget(0.5) == 0  # the weights are over it


def test_out_of_memory_is_recognised_through_the_errors_it_caused():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture") from None
    except RuntimeError as exc:
        assert not is_out_of_memory(exc)  # `from None` hides the cause: nothing to go on
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
    assert not is_out_of_memory(RuntimeError("boom"))


def test_the_setting_is_a_share_of_the_gpu(monkeypatch):
    assert ARSettings().gpu_memory_utilization == 0.9
    monkeypatch.setenv("ARDIT_AR_GPU_MEMORY_UTILIZATION", "0.55")
    assert ARSettings().gpu_memory_utilization == 0.55
    for bad in ("0", "1.2"):
        monkeypatch.setenv("ARDIT_AR_GPU_MEMORY_UTILIZATION", bad)
        with pytest.raises(ValidationError):
            ARSettings()


# -- the engine ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tiny_root):
    from servicekit.checkpoint import open_checkpoint

    return open_checkpoint(tiny_root)


@pytest.fixture(scope="module")
def needed(tiny_ar, checkpoint):
    """needed(images): the decode memory of that many images on the tiny model, as the engine sizes it."""
    engine = make_engine(tiny_ar, checkpoint, max_batch_size=1, fast_decode=True)
    positions, static = engine.max_positions(), engine.decoder.static
    engine.close()
    config, dtype_bytes = tiny_ar.config, tiny_ar.model.dtype.itemsize
    per_slot = decode_bytes_per_slot(config, positions, dtype_bytes)

    def needed(images: int) -> int:
        rows = ROWS_PER_IMAGE * images
        widest = lane_rows_for(0, rows, static.kernels)  # a step of lanes: the decoder's widest
        return rows * per_slot + decode_workspace_bytes(config, widest, positions, dtype_bytes=dtype_bytes,
                                                        shared_slots=static.shared_slots, kernels=static.kernels)

    return needed


@pytest.fixture
def no_margin(monkeypatch):
    """The fixed margin off: the tiny model's figures then differ in the log's units."""
    monkeypatch.setattr(decode_memory, "WORKSPACE_MARGIN", 0)


def memory_for(budget: int, utilization: float = 0.5, held: int = 3 << 20) -> DeviceMemory:
    """A device on which ``utilization`` of the total, less ``held``, is ``budget``."""
    return DeviceMemory(total=int((budget + held) / utilization) + 1, free=HUGE, held=held)


def serve_one(engine, n: int = 3):
    """One image request of ``n`` images through the engine and the fake renderer: its events."""
    job = engine.submit(engine.plan(request_id="r", prompt="a red square", width=64, height=64, n=n, seed=4))
    got = wait_done(job)
    assert isinstance(got[-1], events.JobDone), got[-1]
    return got


def test_a_budget_that_holds_every_image_keeps_them(tiny_ar, checkpoint, needed, caplog, no_margin):
    with caplog.at_level(logging.WARNING, logger="ar_service.engine"):
        engine = make_engine(tiny_ar, checkpoint, max_batch_size=4, fast_decode=True, gpu_memory_utilization=0.5,
                             device_memory=memory_for(needed(4)))
    try:
        assert engine.max_batch_size == 4 and engine.status().max_batch_size == 4
        assert engine.decoder.static.slots == ROWS_PER_IMAGE * 4
        assert not [r for r in caplog.records if "decode memory" in r.getMessage()]
    finally:
        engine.close()


def test_a_budget_for_fewer_images_shrinks_the_batch_says_so_and_serves(tiny_ar, checkpoint, needed, caplog, no_margin):
    renderer = FakeRenderer()
    with caplog.at_level(logging.WARNING, logger="ar_service.engine"):
        engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=4, fast_decode=True,
                             gpu_memory_utilization=0.5, device_memory=memory_for(needed(3) + 100))
    try:
        assert engine.max_batch_size == 3 and engine.status().max_batch_size == 3
        assert engine.decoder.static.slots == ROWS_PER_IMAGE * 3
        [warning] = [r.getMessage() for r in caplog.records if "decode memory" in r.getMessage()]
        assert "max_batch_size 4 does not fit" in warning and "max_batch_size 3 instead" in warning
        figures = [format_bytes(figure) for figure in (needed(4), needed(3) + 100, needed(3))]
        assert figures[0] != figures[1] and all(figure in warning for figure in figures)
        got = serve_one(engine, n=4)  # four images through three decode places
        assert sorted({e.index for e in got if isinstance(e, events.Progress)}) == [0, 1, 2, 3]
        assert len(renderer.sessions) == 4
        status = engine.status()
        assert 1 <= status.largest_batch <= 3 and status.completed_total == 1
        registry = engine.metrics.registry  # the batch-size histogram has a bucket at the batch the engine holds
        assert registry.get_sample_value("ardit_ar_batch_size_bucket", {"le": "3.0"}) is not None
    finally:
        engine.close()


def test_a_budget_below_one_image_refuses_the_start_with_the_figures(tiny_ar, checkpoint, needed, no_margin):
    budget = needed(1) - 1
    with pytest.raises(DecodeMemoryError) as refused:
        make_engine(tiny_ar, checkpoint, max_batch_size=4, fast_decode=True, gpu_memory_utilization=0.5,
                    device_memory=memory_for(budget))
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)
    assert format_bytes(needed(1)) in message and format_bytes(budget) in message
    assert "gpu_memory_utilization" in message and "ARDIT_AR_GPU_MEMORY_UTILIZATION" in message
    assert (refused.value.needed, refused.value.available) == (needed(1), budget)


def test_the_eager_decoder_and_the_cpu_without_figures_are_not_sized(tiny_ar, checkpoint):
    """No device figures (the CPU): the batch asked for. The eager decoder is never sized, whatever the figures."""
    fast = make_engine(tiny_ar, checkpoint, max_batch_size=4, fast_decode=True)
    eager = make_engine(tiny_ar, checkpoint, max_batch_size=4, device_memory=memory_for(0))
    try:
        assert fast.max_batch_size == 4 and fast.decoder.static.slots == ROWS_PER_IMAGE * 4
        assert eager.max_batch_size == 4
    finally:
        fast.close()
        eager.close()


def test_out_of_memory_while_capturing_builds_the_decoder_again_with_half_the_images(tiny_ar, checkpoint, monkeypatch,
                                                                                    caplog):
    warm_up = StaticDecoder.warm_up
    failed: list[weakref.ref] = []

    def out_of_memory_once(self, positions, lanes=False):
        if not failed:
            failed.append(weakref.ref(self))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return warm_up(self, positions, lanes)

    monkeypatch.setattr(StaticDecoder, "warm_up", out_of_memory_once)
    renderer = FakeRenderer()
    with caplog.at_level(logging.WARNING, logger="ar_service.engine"):
        engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=4, fast_decode=True)
    try:
        assert engine.max_batch_size == 2 and engine.status().max_batch_size == 2
        assert engine.decoder.static.slots == ROWS_PER_IMAGE * 2
        gc.collect()
        assert failed[0]() is None  # the decoder that ran out of memory was let go
        [warning] = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
        assert "for 4 images" in warning and "building it for 2" in warning and "20.00 GiB" in warning
        serve_one(engine, n=3)
        assert len(renderer.sessions) == 3 and engine.status().largest_batch <= 2
    finally:
        engine.close()


def test_out_of_memory_even_for_one_image_refuses_the_start(tiny_ar, checkpoint, monkeypatch):
    attempts: list[int] = []

    def always_out_of_memory(self, positions, lanes=False):
        attempts.append(self.slots)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(StaticDecoder, "warm_up", always_out_of_memory)
    with pytest.raises(DecodeMemoryError, match="one image") as refused:
        make_engine(tiny_ar, checkpoint, max_batch_size=5, fast_decode=True)
    assert attempts == [10, 4, 2]  # 5 images, then 2, then 1
    assert "gpu_memory_utilization" in str(refused.value)


def test_other_errors_while_building_the_decoder_are_not_taken_for_lack_of_memory(tiny_ar, checkpoint, monkeypatch):
    def broken(self, positions, lanes=False):
        raise RuntimeError("a kernel failed to compile")

    monkeypatch.setattr(StaticDecoder, "warm_up", broken)
    with pytest.raises(RuntimeError, match="failed to compile"):
        make_engine(tiny_ar, checkpoint, max_batch_size=4, fast_decode=True)


@pytest.mark.parametrize("capture", [False, True])
def test_capture_lane_graphs_asks_the_warm_up_for_the_lanes_graphs(tiny_ar, checkpoint, monkeypatch, capture):
    """The setting decides whether the start captures the graphs of steps of lanes (speculative and row_parallel
    steps under load otherwise pay for their first capture); the env name is the documented one."""
    monkeypatch.setenv("ARDIT_AR_CAPTURE_LANE_GRAPHS", "true" if capture else "false")
    asked: list[bool] = []
    warm_up = StaticDecoder.warm_up

    def recording(self, positions, lanes=False):
        asked.append(lanes)
        return warm_up(self, positions, lanes)

    monkeypatch.setattr(StaticDecoder, "warm_up", recording)
    engine = make_engine(tiny_ar, checkpoint, max_batch_size=2, fast_decode=True,
                         capture_lane_graphs=ARSettings().capture_lane_graphs)
    try:
        assert asked == [capture]
    finally:
        engine.close()
