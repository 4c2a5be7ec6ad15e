"""The AR engine's continuous batching without a socket: batch invariance, the shared prefix cache,
admission control, cancellation, status and metrics (a fake renderer records what would go to the DiT)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from ar_service import events
from ar_service.conditions import prompt_ids_for
from ar_service.decoding.decoders import EagerDecoder, decode_together
from ar_service.decoding.stream import DecodeStream
from ar_service.engine import AREngine, QueueFull
from ar_service.generation import generate_grid
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from protos.knobs import FAMILIES
from servicekit.checkpoint import open_checkpoint


class FakeSession:
    def __init__(self, header, on_event):
        self.header, self.on_event = header, on_event
        self.sent: list[tuple[str, int, torch.Tensor]] = []
        self.cancelled = False

    def send_condition(self, kind, offset, hidden):
        self.sent.append((kind, offset, hidden.clone()))

    def finish(self):
        self.on_event(events.RenderDone(self.header.index, {}))

    def cancel(self):
        self.cancelled = True


class FakeRenderer:
    def __init__(self, gate: threading.Event | None = None):
        self.sessions: list[FakeSession] = []
        self.gate = gate
        self.opened = threading.Event()

    def open(self, header, on_event, timeout=None):
        self.opened.set()
        if self.gate is not None:
            self.gate.wait(30)
        session = FakeSession(header, on_event)
        self.sessions.append(session)
        return session


@pytest.fixture(scope="module")
def checkpoint(tiny_root):
    return open_checkpoint(tiny_root)


def make_engine(tiny_ar, checkpoint, renderer=None, **kw):
    return AREngine(tiny_ar, checkpoint, FAMILIES[checkpoint.family], renderer or FakeRenderer(), **kw)


def wait_done(job, timeout=60):
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            event = job.events.get(timeout=0.05)
        except Exception:
            continue
        got.append(event)
        if isinstance(event, (events.JobDone, events.JobFailed)):
            return got
    raise AssertionError("job did not finish")


def conditions(renderer: FakeRenderer, request_id: str) -> dict[int, list[tuple[str, int, torch.Tensor]]]:
    return {s.header.index: s.sent for s in renderer.sessions if s.header.request_id == request_id}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for index in a:
        assert [(k, o) for k, o, _ in a[index]] == [(k, o) for k, o, _ in b[index]]
        for (_, _, x), (_, _, y) in zip(a[index], b[index], strict=True):
            assert torch.equal(x, y)


def wait_for(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def test_prefix_cache_gives_the_same_tokens_and_hidden_states(tiny_ar):
    grid = grid_for_size(128, 128, 16)
    t2i = tiny_ar.t2i
    sampling = SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p)
    prefix_ids = system_prefix_ids(tiny_ar.tokenizer)
    ids = prompt_ids_for(tiny_ar.tokenizer, "a cat on a mat", grid)
    assert ids[: len(prefix_ids)] == prefix_ids and len(prefix_ids) > 5
    cache = build_prefix_cache(tiny_ar.model, prefix_ids)
    without = generate_grid(tiny_ar.model, ids, grid, t2i, sampling, 42, prefix_ids=prefix_ids)
    with_cache = generate_grid(tiny_ar.model, ids, grid, t2i, sampling, 42, prefix=cache)
    assert with_cache.token_ids == without.token_ids
    assert torch.equal(with_cache.text_condition, without.text_condition)
    assert torch.equal(with_cache.image_condition, without.image_condition)
    assert cache.cache.length == len(prefix_ids)  # the shared cache is copied, never written


def test_batched_decode_step_is_row_independent(tiny_ar):
    """The padded batched forward: a stream's tokens and states alone equal those among 7 others joining late."""
    t2i = tiny_ar.t2i
    sampling = SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p)
    prefix = build_prefix_cache(tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer))
    grid = grid_for_size(128, 128, 16)

    def stream(prompt, size, seed, rows):
        g = grid_for_size(*size, 16)
        ids = prompt_ids_for(tiny_ar.tokenizer, prompt, g)
        return DecodeStream(tiny_ar.model, ids, g, t2i, sampling, seed, lambda r, h, t: rows.append(h), prefix=prefix)

    alone_rows: list[torch.Tensor] = []
    alone = generate_grid(
        tiny_ar.model, prompt_ids_for(tiny_ar.tokenizer, "a cat", grid), grid, t2i, sampling, 5,
        on_row=lambda r, h, t: alone_rows.append(h), prefix=prefix,
    )
    rows: list[torch.Tensor] = []
    target = stream("a cat", (128, 128), 5, rows)
    joiners = [stream(f"dog number {k}", (64 + 16 * k, 96), 100 + k, []) for k in range(7)]
    decode_together(EagerDecoder(tiny_ar.model, pad_to=8), [target], joiners, join_every=3)
    assert target.tokens == alone.token_ids
    assert torch.equal(torch.cat(rows), alone.image_condition)


@pytest.mark.parametrize(
    "decoder",
    [{}, {"fast_decode": True, "deterministic": True},
     {"fast_decode": True, "deterministic": True, "decode_lookahead": True}],
    ids=["eager", "fast-deterministic", "fast-deterministic-lookahead"],
)
def test_engine_batch_invariance_and_status(tiny_ar, checkpoint, decoder):
    """8 requests (other prompts, seeds, sizes, n, joining at different times): each one's conditions equal its run
    alone, bit for bit, with the eager decoder and with the fast decoder in deterministic mode (the fast decoder's
    default mode fails this: it runs as few rows as the batch needs, and CPU BLAS rounds by row count)."""
    renderer = FakeRenderer()
    engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=8, max_queued_requests=16, **decoder)
    specs = [
        dict(prompt=f"scene {k}", width=64 + 16 * (k % 3), height=64, seed=10 * k, n=1 + (k % 2),
             knobs={"num_inference_steps": 2})
        for k in range(8)
    ]
    specs[3]["negative_prompt"] = "blurry"
    try:
        alone = {}
        for k, spec in enumerate(specs):
            job = engine.submit(engine.plan(request_id=f"alone-{k}", **spec))
            assert isinstance(wait_done(job)[-1], events.JobDone)
            alone[k] = conditions(renderer, f"alone-{k}")
        assert engine.status().largest_batch <= 2  # n = 2 requests ran their two images together
        jobs = []
        for k, spec in enumerate(specs):
            jobs.append(engine.submit(engine.plan(request_id=f"batch-{k}", **spec)))
            if k % 3 == 2:
                time.sleep(0.05)  # later ones join a batch already decoding
        for job in jobs:
            assert isinstance(wait_done(job)[-1], events.JobDone)
        for k in range(8):
            assert_same(conditions(renderer, f"batch-{k}"), alone[k])
        status = engine.status()
        assert status.largest_batch > 2 and status.batched_steps_total > 0
        assert status.running == 0 and status.queued == 0
        assert status.admitted_total == status.completed_total == 16
        assert status.max_batch_size == 8 and status.queue_capacity == 16
        registry = engine.metrics.registry
        assert registry.get_sample_value("ardit_ar_requests_completed_total") == 16
        assert registry.get_sample_value("ardit_ar_batch_size_count") > 0
        # every token step is observed once (a count of observations, no clock read by the test)
        assert registry.get_sample_value("ardit_ar_decode_step_seconds_count") >= status.batched_steps_total > 0
        assert registry.get_sample_value("ardit_ar_running_streams") == 0
        if decoder.get("decode_lookahead"):  # most steps were launched ahead and taken; joins and leaves waste some
            static = engine.decoder.static
            assert static.ahead_taken > 10 * static.ahead_wasted > 0
    finally:
        engine.close()


def test_full_queue_refuses_at_once_with_retry_after(tiny_ar, checkpoint):
    gate = threading.Event()
    renderer = FakeRenderer(gate)
    engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=1, max_queued_requests=1)
    try:
        plan = lambda rid: engine.plan(request_id=rid, prompt="p", width=64, height=64, seed=1)  # noqa: E731
        first = engine.submit(plan("a"))
        assert renderer.opened.wait(10)  # the worker took "a" and holds it at the renderer
        second = engine.submit(plan("b"))
        started = time.monotonic()
        with pytest.raises(QueueFull) as refused:
            engine.submit(plan("c"))
        assert time.monotonic() - started < 0.5
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_s >= 1
        status = engine.status()
        assert (status.queued, status.rejected_total, status.admitted_total) == (1, 1, 2)
        assert engine.metrics.registry.get_sample_value("ardit_ar_requests_rejected_total") == 1
        gate.set()
        assert isinstance(wait_done(first)[-1], events.JobDone)
        assert isinstance(wait_done(second)[-1], events.JobDone)
        assert isinstance(wait_done(engine.submit(plan("d")))[-1], events.JobDone)  # serves normally afterwards
    finally:
        gate.set()
        engine.close()


def test_cancel_mid_decode_frees_the_slot_and_leaves_batch_mates_unchanged(tiny_ar, checkpoint):
    renderer = FakeRenderer()
    engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=4)
    mate = dict(prompt="a quiet harbour", width=128, height=128, seed=77)
    try:
        wait_done(engine.submit(engine.plan(request_id="mate-alone", **mate)))
        victim = engine.submit(engine.plan(request_id="victim", prompt="a storm", width=512, height=512, seed=3, n=2))
        job = engine.submit(engine.plan(request_id="mate-batched", **mate))
        progress = 0
        while progress < 2:
            event = victim.events.get(timeout=30)
            progress += isinstance(event, events.Progress)
        victim.cancel()
        assert isinstance(wait_done(job)[-1], events.JobDone)
        assert_same(conditions(renderer, "mate-batched"), conditions(renderer, "mate-alone"))
        wait_for(lambda: engine.status().running == 0)
        status = engine.status()
        assert status.queued == 0 and status.cancelled_total == 1 and status.completed_total == 2
        assert all(s.cancelled for s in renderer.sessions if s.header.request_id == "victim")
        victim_rows = [s for s in renderer.sessions if s.header.request_id == "victim"][0].sent
        assert len(victim_rows) < 1 + 32  # text + far fewer than the 32 rows of a 512x512 grid
    finally:
        engine.close()


def test_deadline_removes_a_request_within_a_token(tiny_ar, checkpoint):
    engine = make_engine(tiny_ar, checkpoint, max_batch_size=2)
    try:
        job = engine.submit(engine.plan(prompt="slow", width=512, height=512, seed=1), timeout=0.3)
        wait_for(lambda: engine.status().cancelled_total == 1, timeout=30)
        assert job.cancelled.is_set() and engine.status().running == 0
    finally:
        engine.close()
