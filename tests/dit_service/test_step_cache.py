"""Step caching (the ``dit_cache_threshold`` knob) on the tiny DiT: off gives today's bits, on computes fewer steps,
an image's result does not depend on what it is batched with, guidance changes force a computed step, bad values
are refused naming the range."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from dit_service.engine import DiTEngine, FinishedImage, RenderDone, RenderFailed
from dit_service.model.sampler import step_entries
from protos.knobs import FAMILIES
from protos.status import RequestRejected
from protos.timings import stage_timings

HIDDEN = 64
STEPS = 24


def make_engine(pipeline, **kwargs) -> DiTEngine:
    return DiTEngine(pipeline, FAMILIES["mammothmoda2"], max_condition_positions=4096, **kwargs)


def plan(engine, seed, knobs, size=64):
    return engine.plan(request_id=f"r{seed}", width=size, height=size, n=1, seed=seed, output_format="png",
                       output_compression=None, knobs=knobs, hidden_size=HIDDEN, dtype="float32", text_positions=4,
                       image_positions=6, negative_positions=0)


def submit(engine, seed, knobs, cond_seed=0):
    g = torch.Generator().manual_seed(cond_seed)
    condition = torch.cat([torch.randn(4, HIDDEN, generator=g), torch.randn(6, HIDDEN, generator=g)])
    return engine.submit(plan(engine, seed, knobs), condition, torch.zeros(0, HIDDEN))


def result(job, timeout=120) -> tuple[bytes, dict]:
    image = None
    while True:
        event = job.events.get(timeout=timeout)
        if isinstance(event, RenderFailed):
            raise event.error
        if isinstance(event, FinishedImage):
            image = event.data
        if isinstance(event, RenderDone):
            assert image is not None
            return image, event.timings


def knobs(threshold=None, guidance=4.0):
    chosen = {"num_inference_steps": STEPS, "text_guidance_scale": guidance}
    if threshold is not None:
        chosen["dit_cache_threshold"] = threshold
    return chosen


@pytest.fixture(scope="module")
def engine(pipeline):
    running = make_engine(pipeline, max_batch_size=4)
    yield running
    running.close()


def test_threshold_zero_gives_the_bits_of_no_knob_and_computes_every_step(engine):
    plain, plain_timings = result(submit(engine, 3, knobs()))
    zero, zero_timings = result(submit(engine, 3, knobs(0.0)))
    assert zero == plain
    for timings in (plain_timings, zero_timings):
        assert timings["dit_steps_computed"] == STEPS and timings["dit_steps_skipped"] == 0
    assert zero_timings["transformer_calls"] == plain_timings["transformer_calls"] == 2 * STEPS


def test_a_threshold_skips_steps_and_counts_them(engine):
    _, timings = result(submit(engine, 3, knobs(0.3)))
    assert timings["dit_steps_skipped"] > 0
    assert timings["dit_steps_computed"] + timings["dit_steps_skipped"] == STEPS
    assert timings["transformer_calls"] == 2 * timings["dit_steps_computed"]  # guided: both branches skipped together
    registry = engine.metrics.registry
    assert registry.get_sample_value("ardit_dit_denoise_steps_total", {"outcome": "skipped"}) >= timings["dit_steps_skipped"]
    assert registry.get_sample_value("ardit_dit_denoise_steps_total", {"outcome": "computed"}) >= timings["dit_steps_computed"]
    summary = stage_timings(timings)  # what the Render summary carries
    assert (summary.dit_steps_computed, summary.dit_steps_skipped) == (timings["dit_steps_computed"],
                                                                       timings["dit_steps_skipped"])


def test_a_larger_threshold_skips_at_least_as_many_steps(engine):
    counts = [result(submit(engine, 5, knobs(threshold)))[1]["dit_steps_skipped"] for threshold in (0.1, 0.3, 0.8)]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_an_image_with_caching_is_the_same_alone_and_batched(pipeline):
    alone_engine = make_engine(pipeline, max_batch_size=1)
    batched_engine = make_engine(pipeline, max_batch_size=4, batch_window_s=0.5)
    try:
        alone, alone_timings = result(submit(alone_engine, 7, knobs(0.3)))
        jobs = [submit(batched_engine, 7, knobs(0.3)),
                submit(batched_engine, 11, knobs(0.0), cond_seed=1),
                submit(batched_engine, 13, knobs(0.6, guidance=1.0), cond_seed=2)]
        batched, batched_timings = result(jobs[0])
        others = [result(job)[1] for job in jobs[1:]]
        assert batched_engine.status()["largest_batch"] > 1
        assert batched == alone
        assert batched_timings["dit_steps_skipped"] == alone_timings["dit_steps_skipped"] > 0
        assert others[0]["dit_steps_skipped"] == 0
    finally:
        alone_engine.close()
        batched_engine.close()


def test_a_step_where_guidance_changes_is_computed(pipeline):
    """cfg_range (0, 0.5): the last computed velocity of the guided half is never carried into the unguided half."""
    g = torch.Generator().manual_seed(0)
    condition = torch.randn(10, HIDDEN, generator=g)
    entry = pipeline.start_entry(condition[:4], condition[4:], torch.zeros(0, HIDDEN), 64, 64, seed=1, steps=STEPS,
                                 guidance=4.0, cfg_range=(0.0, 0.5), cache_threshold=1.0)
    computed = []

    def recording(*args):
        computed.append(entry.step)
        return pipeline.step_model(*args)

    while not entry.done:
        step_entries(recording, [entry], pipeline.dtype, indicator=pipeline.transformer.cache_indicator)
    first_unguided = next(i for i in range(STEPS) if not dataclasses.replace(entry, step=i).wants_cfg())
    assert 0 in computed and STEPS - 1 in computed and first_unguided in computed
    assert entry.skipped_steps > 0 and entry.computed_steps == len(computed)


@pytest.mark.parametrize("value, message", [
    (-0.1, ">= 0 and <= 1; got -0.1"), (1.5, ">= 0 and <= 1; got 1.5"), ("high", "must be a number (>= 0 and <= 1)"),
    (True, "must be a number"),
])
def test_bad_thresholds_are_refused_naming_the_range(engine, value, message):
    with pytest.raises(RequestRejected) as caught:
        plan(engine, 1, {"dit_cache_threshold": value})
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.param == "dit_cache_threshold"
    assert message in caught.value.message


def test_a_misspelt_knob_is_refused_naming_the_accepted_ones(engine):
    with pytest.raises(RequestRejected, match="accepted parameters: .*dit_cache_threshold"):
        plan(engine, 1, {"dit_cache_thresh": 0.2})
