"""dit_service's engine: queues planned renders (dit_service/planning.py) and runs them in a step-level batch.

Sits between the gRPC transport (server.py) and the model (model/): no grpc here, no model math in the
transport. One worker thread owns the GPU/CPU. Renders are admitted into a bounded FIFO queue (a full queue
refuses at once: ``QueueFull``, RESOURCE_EXHAUSTED on the wire); their images join a running batch of at most
``max_batch_size`` images of the same size between denoise steps, each at its own step, timestep, guidance and
step count, and leave it when done (after the VAE decode; an encoder thread beside the worker encodes and sends the
image) or cancelled (client gone, deadline passed). Every step is one transformer call for the whole batch with both
CFG branches packed. On CPU an image comes out bit
for bit the same whatever it was batched with (the transformer keeps each row's arithmetic independent of its
batch-mates; tests/dit_service/test_batching.py); ``deterministic=True`` runs each image in a call of its
own and asks PyTorch for deterministic kernels, for the same guarantee on CUDA at the cost of batching.

An edit (reference images, MammothModa2-Dev) is a render like any other once planned: its size is its last
reference's, it batches with renders of that size, text to image included; its references go through the VAE encoder
once, when its first image joins, and each image draws its reference latents from their posteriors with its own seed.

Under load, renders of one size reach the DiT spread out (each client's AR finishes on its own schedule), and a
render that starts alone finishes alone however many arrive behind it. So a render about to start a new batch
while other renders are already admitted (their conditions still arriving) waits up to ``batch_window_s`` for
more of its size, up to a full batch, and they then run and finish together; their clients' next requests then
reach the DiT together too. With nothing else admitted (one user) it starts at once: the window costs a lone
request nothing.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dit_service.imaging import PNG_COMPRESS_LEVEL, PREVIEW_PNG_COMPRESS_LEVEL, encode_image, enlarge
from dit_service.model.pipeline import DiTPipeline
from dit_service.model.sampler import DenoiseCancelled
from dit_service.planning import (  # noqa: F401  (names callers import from here)
    FORMATS,
    MAX_IMAGES,
    ConditionAssembler,
    RenderPlan,
    RenderPlanner,
)
from protos.knobs import KnobTable
from servicekit import tracing
from servicekit.checkpoint import ModelIdentity
from servicekit.devices import DeviceTimer
from servicekit.image_events import FinishedImage, PreviewImage, Progress
from servicekit.profiling import BusyProfiler, stage

log = logging.getLogger(__name__)

#: Threads that encode finished images beside the worker: at least two, so one slow image does not hold up the
#: next; at most four or half the cores, to leave the worker and gRPC their CPU.
IMAGE_ENCODERS = max(2, min(4, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class RenderDone:
    seed: int
    knobs: dict[str, Any]
    timings: dict[str, float]


@dataclass(frozen=True)
class RenderFailed:
    error: BaseException


class QueueFull(Exception):
    """The render queue is at its bound: refused at once (RESOURCE_EXHAUSTED), retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class RenderJob:
    plan: RenderPlan
    condition: torch.Tensor
    uncond: torch.Tensor
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    condition_complete_at: float = field(default_factory=time.perf_counter)
    # batching state, owned by the engine's worker
    next_image: int = 0  # images 0 .. next_image-1 have joined the running batch
    images_done: int = 0
    finished: bool = False  # RenderDone or RenderFailed has been sent
    timings: dict[str, float] = field(default_factory=dict)
    wake: Any = None  # the engine's wake-up, so a cancel is seen within one step
    trace: Any = None  # the render's trace context (servicekit.tracing); None when tracing is off
    # (conditional, unconditional) condition as the steps take it (pipeline.branch_conditions): made when the first
    # image joins, shared by the render's images (the refiner or Q-Former runs once per render), dropped by the last
    branch_conditions: Any = None
    # An edit's reference images, preprocessed ([3, H, W] in [-1, 1]; planning.ConditionAssembler.complete_references),
    # and their VAE posteriors (pipeline.encode_references): encoded when the first image joins, once per render;
    # each image then samples its reference latents from them with its own seed. None for text to image.
    references: list[torch.Tensor] | None = None
    reference_posteriors: Any = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.wake is not None:
            self.wake()


@dataclass
class _Running:
    """One image of a job in the running batch."""

    job: RenderJob
    image: int
    entry: Any  # sampler.DenoiseEntry (or a test double)
    joined_at: float
    denoise_s: float = 0.0
    span: Any = None  # dit.denoise, from joining the batch to the last step (None when tracing is off)
    previews: list[Future] = field(default_factory=list)  # partial images still being encoded


@dataclass
class _IssuedStep:
    """A denoise step issued to the device: its batch, each image's step count after it, and its device time."""

    batch: list[_Running]
    steps: list[int]
    timer: DeviceTimer


class EngineMetrics:
    """Prometheus metrics of one engine, on its own registry (served by ``start_http_server(port, registry=...)``)."""

    def __init__(self, max_batch_size: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("ardit_dit_queue_depth", "renders admitted and waiting to join the batch", registry=r)
        self.running = Gauge("ardit_dit_running_batch_size", "images in the running batch", registry=r)
        buckets = sorted({1, 2, 4, 8, 16, 32, max_batch_size})
        self.batch_size = Histogram("ardit_dit_batch_size", "images per denoise step", buckets=buckets, registry=r)
        self.admitted = Counter("ardit_dit_renders_admitted", "renders admitted to the queue", registry=r)
        self.rejected = Counter("ardit_dit_renders_rejected", "renders refused: queue full", registry=r)
        self.cancelled = Counter("ardit_dit_renders_cancelled", "renders that left early", registry=r)
        self.completed = Counter("ardit_dit_renders_completed", "renders finished", registry=r)
        self.step_seconds = Histogram(
            "ardit_dit_step_seconds", "wall time of one batched denoise step",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r,
        )
        self.steps = Counter(
            "ardit_dit_denoise_steps", "denoising steps of finished images, by outcome: computed (ran the transformer) "
            "or skipped (reused the last computed velocity, dit_cache_threshold)", ["outcome"], registry=r,
        )
        self.window_seconds = Histogram(
            "ardit_dit_batch_window_seconds", "time a new batch waited for more renders of its size (batch_window_s)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r,
        )


class DiTEngine:
    """Queues planned renders and denoises them in a step-level batch, in arrival order. Planning (a header checked
    into a ``RenderPlan``, chunks into its condition) is its ``planner``'s (dit_service/planning.py); the constructor
    takes the planner's limits so that one object serves a Render."""

    def __init__(
        self,
        pipeline: DiTPipeline,
        knob_table: KnobTable,
        max_condition_positions: int,
        *,
        max_side: int | None = None,
        max_pixels: int | None = None,
        max_chunk_bytes: int | None = None,
        max_condition_chunks: int | None = None,
        max_batch_size: int = 4,
        max_queued_renders: int = 16,
        deterministic: bool = False,
        batch_window_s: float = 0.0,
        profiler: BusyProfiler | None = None,
        knob_defaults: Mapping[str, Any] | None = None,
        identity: ModelIdentity | None = None,
        max_reference_bytes: int | None = None,
        png_compress_level: int = PNG_COMPRESS_LEVEL,
    ):
        """``batch_window_s``: how long a render about to start a new batch waits for more renders of its size while
        others are admitted (0: never waits; see the module docstring). ``knob_defaults``: the checkpoint's
        (``ardit_serving.json``), over the family's, for the DiT knobs a Render header leaves out. ``identity``: the
        served checkpoint's; a header that names another model is refused (None: nothing is checked)."""
        if max_batch_size < 1 or max_queued_renders < 1:
            raise ValueError("max_batch_size and max_queued_renders must be at least 1")
        if batch_window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0; got {batch_window_s}")
        self.pipeline = pipeline
        self.planner = RenderPlanner(
            size_multiple=pipeline.size_multiple,
            condition_dim=pipeline.condition_dim,
            requires_image_condition=pipeline.requires_image_condition,
            knob_table=knob_table,
            max_condition_positions=max_condition_positions,
            max_side=max_side,
            max_pixels=max_pixels,
            max_chunk_bytes=max_chunk_bytes,
            max_condition_chunks=max_condition_chunks,
            knob_defaults=knob_defaults,
            identity=identity,
            max_reference_images=getattr(pipeline, "max_reference_images", 0),
            **({} if max_reference_bytes is None else {"max_reference_bytes": max_reference_bytes}),
        )
        self.max_batch_size = max_batch_size
        self.max_queued_renders = max_queued_renders
        self.deterministic = deterministic
        self.batch_window_s = batch_window_s
        self.png_compress_level = png_compress_level
        self.metrics = EngineMetrics(max_batch_size)
        self.profiler = profiler  # None: no tracing, stage labels are a shared no-op
        self._lock = threading.Condition()
        self._queue: deque[RenderJob] = deque()
        self._reserved = 0  # admitted at their header, condition still arriving
        self._running: list[_Running] = []
        self._in_flight: _IssuedStep | None = None  # the step issued last, not yet waited for (_step)
        self._closed = False
        self._step_ewma_s = 0.5
        self.counters = dict(admitted=0, rejected=0, cancelled=0, completed=0, largest_batch=0, batched_steps=0,
                             windows=0)
        # Images are encoded beside the worker: a PNG encode at 1024x1024 takes longer than a denoise step, and the
        # batch's next step need not wait for it (Pillow releases the GIL while it compresses). Partial images go
        # through one thread, in order; finished images through IMAGE_ENCODERS.
        self._preview_encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dit-preview")
        self._image_encoder = ThreadPoolExecutor(max_workers=IMAGE_ENCODERS, thread_name_prefix="dit-encode")
        self._worker = threading.Thread(target=self._work, name="dit-worker", daemon=True)
        self._worker.start()

    # -- planning -------------------------------------------------------------------------

    def plan(self, **header: Any) -> RenderPlan:
        """The planner's ``plan`` (dit_service/planning.py), for callers that hold only the engine."""
        return self.planner.plan(**header)

    # -- admission ------------------------------------------------------------------------

    def _queued(self) -> int:
        return self._reserved + len(self._queue)

    def _retry_after_s(self) -> int:
        """A guess at when a slot frees: the queued and running images' remaining steps, in batches."""
        steps = [r.entry.steps - r.entry.step for r in self._running]
        steps += [j.plan.knobs["num_inference_steps"] * (j.plan.n - j.next_image) for j in self._queue]
        waves = max(1, sum(steps)) / self.max_batch_size
        return max(1, min(60, math.ceil(waves * self._step_ewma_s)))

    def _refuse(self) -> QueueFull:
        self.counters["rejected"] += 1
        self.metrics.rejected.inc()
        return QueueFull(
            f"dit_service is at capacity: {self._queued()} renders queued (max_queued_renders "
            f"{self.max_queued_renders}); retry later",
            self._retry_after_s(),
        )

    def admit(self) -> None:
        """Takes a queue slot for a Render whose condition is about to arrive; raises QueueFull when none is free.

        Checked at the header, so a caller learns at once and no condition is streamed for nothing. Follow with
        ``submit(..., admitted=True)`` or ``withdraw()``."""
        with self._lock:
            if self._closed or self._queued() >= self.max_queued_renders:
                raise self._refuse()
            self._reserved += 1
            self.counters["admitted"] += 1
            self.metrics.admitted.inc()
            self.metrics.queue_depth.set(self._queued())

    def withdraw(self, cancelled: bool = False) -> None:
        """Gives back an ``admit`` slot whose stream failed before its end marker (``cancelled``: the caller left)."""
        with self._lock:
            self._reserved = max(0, self._reserved - 1)
            if cancelled:
                self.counters["cancelled"] += 1
                self.metrics.cancelled.inc()
            self.metrics.queue_depth.set(self._queued())
            self._lock.notify_all()  # a batch window waiting on this render need not wait any longer

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(
                queued=self._queued(),
                running=len(self._running),
                queue_capacity=self.max_queued_renders,
                max_batch_size=self.max_batch_size,
                admitted_total=self.counters["admitted"],
                rejected_total=self.counters["rejected"],
                cancelled_total=self.counters["cancelled"],
                completed_total=self.counters["completed"],
                largest_batch=self.counters["largest_batch"],
                batched_steps_total=self.counters["batched_steps"],
            )

    # -- running --------------------------------------------------------------------------

    def assembler(self, plan: RenderPlan) -> ConditionAssembler:
        return self.planner.assembler(plan)

    def submit(
        self, plan: RenderPlan, condition: torch.Tensor, uncond: torch.Tensor, admitted: bool = False, trace: Any = None,
        references: list[torch.Tensor] | None = None,
    ) -> RenderJob:
        """Queues a render (FIFO). Without a prior ``admit`` the bound is checked here (QueueFull).

        ``trace``: the render's trace context; each image's denoise, VAE decode and encode spans open under it.
        ``references``: an edit's preprocessed reference images (``ConditionAssembler.complete_references``); the plan
        then has their size."""
        if (references is not None) != bool(plan.reference_images) or (
            references is not None and len(references) != plan.reference_images
        ):
            raise ValueError(f"the plan declares {plan.reference_images} reference images; got "
                             f"{0 if references is None else len(references)}")
        job = RenderJob(plan=plan, condition=condition, uncond=uncond, wake=self._wake, trace=trace,
                        references=references)
        with self._lock:
            if admitted:
                self._reserved = max(0, self._reserved - 1)
            elif self._closed or self._queued() >= self.max_queued_renders:
                raise self._refuse()
            else:
                self.counters["admitted"] += 1
                self.metrics.admitted.inc()
            self._queue.append(job)
            self.metrics.queue_depth.set(self._queued())
            self._lock.notify_all()
        return job

    def close(self) -> None:
        """Stops after the admitted renders are done."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _work(self) -> None:
        while True:
            if self.profiler is not None and not self._queue and not self._running:
                self.profiler.idle()  # a busy period ended: its trace is written
            with self._lock:
                while not self._queue and not self._running and not self._closed:
                    self._lock.wait()
                if self._closed and not self._queue and not self._running:
                    break
                first = self._queue[0].plan.request_id if self._queue else ""
                self._sweep_queue()
                self._batch_window()
                joiners = self._take_joiners()
            if self.profiler is not None:
                self.profiler.busy(first)  # no-op while a trace is already recording
            try:
                for job, image in joiners:
                    self._join(job, image)
                self._drop_cancelled()
                if self._running:
                    self._step()
                else:
                    self._settle_in_flight()  # every image left (cancelled): the last step still counts
            except BaseException as exc:  # the worker must outlive any one batch
                log.exception("denoise step failed; failing the running batch")
                self._in_flight = None
                for running in list(self._running):
                    self._leave(running, exc)
        # Closed: images already handed to the encoders still go out, then their threads end.
        self._preview_encoder.shutdown(wait=False)
        self._image_encoder.shutdown(wait=False)

    def _sweep_queue(self) -> None:
        """Cancelled renders still waiting leave the queue (under the lock)."""
        for job in [j for j in self._queue if j.cancelled.is_set()]:
            self._queue.remove(job)
            if job.next_image == 0:  # otherwise its running images report it
                self._fail(job, DenoiseCancelled("render cancelled before it started"))
        self.metrics.queue_depth.set(self._queued())

    def _ready_for_batch(self) -> int | None:
        """Images a new batch would start with now (under the lock): the queue's head and the renders of its size
        right behind it (FIFO, no overtaking), at most max_batch_size; None when a render of another size follows
        them, so that waiting could add no image."""
        key = (self._queue[0].plan.width, self._queue[0].plan.height)
        images = 0
        for job in self._queue:
            if (job.plan.width, job.plan.height) != key:
                return None
            images += job.plan.n - job.next_image
            if images >= self.max_batch_size:
                break
        return min(images, self.max_batch_size)

    def _batch_window(self) -> None:
        """Before a new batch starts (nothing running), waits up to ``batch_window_s`` for more renders of its size
        while other renders are admitted with their conditions still arriving (under the lock). Ends early when the
        batch is full, when nothing more is admitted, on a cancel (the wake-up) or on close."""
        if self.batch_window_s <= 0 or self._running or not self._queue or not self._reserved:
            return
        started = time.perf_counter()
        deadline = started + self.batch_window_s
        waited = False
        while self._queue and self._reserved and not self._closed and not self._running:
            ready = self._ready_for_batch()
            remaining = deadline - time.perf_counter()
            if ready is None or ready >= self.max_batch_size or remaining <= 0:
                break
            waited = True
            self._lock.wait(remaining)
            self._sweep_queue()
        if waited:
            self.counters["windows"] += 1
            self.metrics.window_seconds.observe(time.perf_counter() - started)

    def _take_joiners(self) -> list[tuple[RenderJob, int]]:
        """Images that join the running batch now: FIFO, up to max_batch_size, all of one size (under the lock).

        A render of another size waits at the head until the running batch has drained (no overtaking)."""
        free = self.max_batch_size - len(self._running)
        key = (self._running[0].job.plan.width, self._running[0].job.plan.height) if self._running else None
        joiners = []
        while self._queue and free > 0:
            job = self._queue[0]
            size = (job.plan.width, job.plan.height)
            if key is not None and size != key:
                break
            key = size
            take = min(free, job.plan.n - job.next_image)
            joiners += [(job, job.next_image + i) for i in range(take)]
            job.next_image += take
            free -= take
            if job.next_image == job.plan.n:
                self._queue.popleft()
        self.metrics.queue_depth.set(self._queued())
        return joiners

    def _join(self, job: RenderJob, image: int) -> None:
        plan = job.plan
        now = time.perf_counter()
        if job.finished:
            return
        if "dit_queue_ms" not in job.timings:
            job.timings.update(dit_queue_ms=(now - job.condition_complete_at) * 1e3, denoise_ms=0.0, vae_decode_ms=0.0,
                               encode_ms=0.0, preview_ms=0.0, transformer_calls=0,
                               dit_steps_computed=0, dit_steps_skipped=0)
        n_text = plan.positions["text"]  # job.condition is [text | image] (ConditionAssembler.complete)
        try:
            if job.branch_conditions is None:
                job.branch_conditions = self.pipeline.branch_conditions(
                    text_condition=job.condition[:n_text],
                    image_condition=job.condition[n_text:],
                    uncond_condition=job.uncond,
                )
            conditions = job.branch_conditions
            edit = {}
            if job.references is not None:  # an edit: the VAE encodes the references once per render
                if job.reference_posteriors is None:
                    with stage(self.profiler, "dit.vae_encode"), tracing.span("dit.vae_encode", job.trace):
                        job.reference_posteriors = self.pipeline.encode_references(job.references)
                edit = dict(
                    references=self.pipeline.sample_references(job.reference_posteriors, plan.seed + image),
                    image_guidance=plan.knobs.get("image_guidance_scale", 1.0),
                )
            if image == plan.n - 1:  # the last image to join: the entries hold the conditions from here on
                job.branch_conditions = None
                job.references = job.reference_posteriors = None
            entry = self.pipeline.start_prepared_entry(
                conditions,
                width=plan.width,
                height=plan.height,
                seed=plan.seed + image,
                steps=plan.knobs["num_inference_steps"],
                guidance=plan.knobs["text_guidance_scale"],
                cfg_range=tuple(plan.knobs["cfg_range"]),
                cache_threshold=plan.knobs.get("dit_cache_threshold", 0.0),
                **edit,
            )
        except Exception as exc:
            log.exception("render %s could not start", plan.request_id)
            self._fail(job, exc)
            return
        span = tracing.start_span(
            "dit.denoise", job.trace, image_index=plan.index_offset + image, steps=plan.knobs["num_inference_steps"]
        )
        with self._lock:
            self._running.append(_Running(job, image, entry, now, span=span))

    def _fail(self, job: RenderJob, error: BaseException) -> None:
        with self._lock:  # a re-entrant lock: callers may hold it
            if job.finished:
                return
            job.finished = True
            if isinstance(error, DenoiseCancelled):
                self.counters["cancelled"] += 1
                self.metrics.cancelled.inc()
        job.events.put(RenderFailed(error))

    def _leave(self, running: _Running, error: BaseException | None = None) -> None:
        """Takes an image out of the batch and frees its tensors; fails its render when ``error`` is given."""
        with self._lock:
            if running in self._running:
                self._running.remove(running)
            if error is not None:
                if running.job in self._queue:
                    self._queue.remove(running.job)
                self._fail(running.job, error)
        tracing.end_span(running.span, None if error is None else f"{type(error).__name__}: {error}")
        running.span = None
        release = getattr(running.entry, "release", None)
        if release is not None:
            release()

    def _drop_cancelled(self) -> None:
        for running in [r for r in self._running if r.job.cancelled.is_set() or r.job.finished]:
            entry = running.entry
            self._leave(running, DenoiseCancelled(f"render cancelled after {entry.step} of {entry.steps} steps", entry.step))

    def _step(self) -> None:
        """Issues one denoise step for the running batch, then waits for the step issued before it, so that the
        device has this one to run while the host does the bookkeeping and issues the next. A step's time
        (metrics, retry-after, denoise_ms) is read from the device once it is done."""
        batch = list(self._running)
        with stage(self.profiler, "dit.denoise_step"):
            timer = DeviceTimer(self.pipeline.device)
            if self.deterministic:  # each image in a call of its own: the same kernels whatever else is running
                for running in batch:
                    mode = running.job.plan.knobs.get("cfg_execution_mode", "sequential")
                    self.pipeline.step([running.entry], separate=mode == "sequential")
            else:
                self.pipeline.step([r.entry for r in batch])
            timer.stop()
        previous, self._in_flight = self._in_flight, _IssuedStep(batch, [r.entry.step for r in batch], timer)
        if previous is not None:
            self._settle(previous)
        previewed = [r for r in batch if r.entry.step in r.job.plan.preview_steps
                     and not (r.job.finished or r.job.cancelled.is_set())]
        finished = [r for r in batch if r.entry.done]  # never a previewed step: previews precede the last step
        if previewed or finished:
            # This step's progress goes out before its partial image, and its time counts in a finished image's
            # denoise_ms: both wait for the step (a few steps an image).
            self._settle_in_flight()
        self._each(previewed, self._preview, "preview failed")
        self._each(finished, self._finish, "failed")
        self.metrics.running.set(len(self._running))

    def _each(self, images: list[_Running], action: Callable[[_Running], None], failure: str) -> None:
        """``action`` for each image; one that raises leaves the batch, its render failed, and the others go on."""
        for running in images:
            try:
                action(running)
            except Exception as exc:
                log.exception("render %s: %s", running.job.plan.request_id, failure)
                self._leave(running, exc)

    def _settle_in_flight(self) -> None:
        """Waits for the step still on the device, if any, and accounts for it."""
        issued, self._in_flight = self._in_flight, None
        if issued is not None:
            self._settle(issued)

    def _settle(self, issued: _IssuedStep) -> None:
        """Accounts for a step the device has run: its time, the batch's metrics, each image's progress."""
        batch = issued.batch
        elapsed = issued.timer.seconds()
        self._step_ewma_s = 0.8 * self._step_ewma_s + 0.2 * elapsed
        self.metrics.step_seconds.observe(elapsed)
        self.metrics.batch_size.observe(len(batch))
        with self._lock:
            self.counters["largest_batch"] = max(self.counters["largest_batch"], len(batch))
            if len({id(r.job) for r in batch}) > 1:
                self.counters["batched_steps"] += 1
        for running, step in zip(batch, issued.steps, strict=True):
            running.denoise_s += elapsed
            job = running.job
            if not (job.finished or job.cancelled.is_set()):
                job.events.put(Progress(job.plan.index_offset + running.image, "denoise", step, running.entry.steps))

    def _preview(self, running: _Running) -> None:
        """Sends the partial image of the step just run (plan.preview_steps): a linear map of the predicted latents,
        not a VAE decode (pipeline.preview), encoded beside the worker; its time counts as preview_ms, not as
        denoise time."""
        job, plan, entry = running.job, running.job.plan, running.entry
        started = time.perf_counter()
        with stage(self.profiler, "dit.preview"):
            pixels = enlarge(self.pipeline.preview(entry), plan.upscale)
        pixels_s = time.perf_counter() - started
        event = dict(index=plan.index_offset + running.image, partial_index=plan.preview_steps.index(entry.step),
                     step=entry.step, total=entry.steps)

        def encode_and_send() -> None:
            encode_started = time.perf_counter()
            data = encode_image(pixels, plan.output_format, plan.output_compression, png_level=PREVIEW_PNG_COMPRESS_LEVEL)
            job.timings["preview_ms"] += (pixels_s + time.perf_counter() - encode_started) * 1e3
            if not (job.finished or job.cancelled.is_set()):
                job.events.put(PreviewImage(event["index"], event["partial_index"], event["step"], event["total"],
                                            plan.output_format, data, *plan.answered_size))

        running.previews.append(self._preview_encoder.submit(encode_and_send))

    def _finish(self, running: _Running) -> None:
        """The image's VAE decode, on the worker (the GPU's work); its encode and delivery go to an encoder thread
        (``_deliver``), so the batch's next step does not wait for them."""
        job, plan, entry = running.job, running.job.plan, running.entry
        tracing.end_span(running.span, transformer_calls=entry.rows)
        running.span = None
        index = plan.index_offset + running.image
        t1 = time.perf_counter()
        with stage(self.profiler, "dit.vae_decode"), tracing.span("dit.vae_decode", job.trace, image_index=index):
            pixels = self.pipeline.decode(entry.latents)
        pixels = enlarge(pixels, plan.upscale)
        t2 = time.perf_counter()
        with self._lock:
            timings = job.timings
            timings["denoise_ms"] += running.denoise_s * 1e3
            timings["vae_decode_ms"] += (t2 - t1) * 1e3
            timings["transformer_calls"] += entry.rows
            timings["dit_steps_computed"] += entry.computed_steps
            timings["dit_steps_skipped"] += entry.skipped_steps
        self.metrics.steps.labels(outcome="computed").inc(entry.computed_steps)
        self.metrics.steps.labels(outcome="skipped").inc(entry.skipped_steps)
        self._leave(running)
        if not job.finished:
            self._image_encoder.submit(self._deliver, running, index, pixels)

    def _deliver(self, running: _Running, index: int, pixels) -> None:
        """On an encoder thread: encodes a finished image and sends it after its partial images, then the render's
        end once all its images are out. A failed encode fails the render."""
        job, plan = running.job, running.job.plan
        try:
            started = time.perf_counter()
            with tracing.span("dit.encode", job.trace, image_index=index, format=plan.output_format):
                data = encode_image(pixels, plan.output_format, plan.output_compression, png_level=self.png_compress_level)
            encode_s = time.perf_counter() - started
            for preview in running.previews:  # the partial images go out before the image, and count in its timings
                preview.result()
        except Exception as exc:
            log.exception("render %s: encoding image %d failed", plan.request_id, index)
            self._fail(job, exc)
            return
        with self._lock:
            if job.finished:
                return
            timings = job.timings
            timings["encode_ms"] += encode_s * 1e3
            job.events.put(FinishedImage(index, plan.seed + running.image, plan.output_format, data, *plan.answered_size))
            job.images_done += 1
            if job.images_done < plan.n:
                return
            job.finished = True
            timings["total_ms"] = (time.perf_counter() - job.condition_complete_at) * 1e3
            self.counters["completed"] += 1
        self.metrics.completed.inc()
        job.events.put(RenderDone(seed=plan.seed, knobs=plan.knobs, timings=dict(timings)))
