"""ar_service's engine: decodes each planned image's grid, streams it to the renderer.

Between the gRPC transport (server.py) and the model (model/, prefill.py, decoding/); requests are checked into plans by
its ``planner`` (ar_service/planning.py) before they reach the queue. One worker
thread owns the AR model and runs continuous batching: requests wait in a bounded FIFO queue
(full: refused at once with RESOURCE_EXHAUSTED and a retry-after estimate); each image of a
request becomes a decode stream (seed + i, its own KV cache, position, grid column and
sampling generator) that joins the running batch after its prefill and leaves it when done,
cancelled or failed, all at token boundaries. Every token step runs one batched forward for
all running streams, padded to ``max_batch_size`` rows so that a stream's numbers do not depend
on its batch-mates (batch invariance). The system-prompt prefix is prefilled once and its K/V
copied into each stream. For image i the worker opens a Render stream, sends the prompt's text
condition after prefill, then every grid row as soon as it is decoded.
"""

from __future__ import annotations

import gc
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import grpc
import torch

from ar_service import events
from ar_service.conditions import ANSWER_WINDOW, PROMPT_TAIL, ConditionLengthError, grid_condition_offset, prompt_ids_for
from ar_service.decoding import SEQUENTIAL, Decoding
from ar_service.decoding.decoders import ROWS_PER_IMAGE, EagerDecoder, SlotDecoder
from ar_service.decoding.stream import DecodeStream
from ar_service.metrics import EngineMetrics
from ar_service.model.decode_memory import (
    DecodeMemoryError,
    DeviceMemory,
    cuda_memory,
    decode_bytes_per_slot,
    decode_workspace_bytes,
    fit_batch,
    format_bytes,
    is_out_of_memory,
)
from ar_service.model.loading import LoadedAR
from ar_service.model.static_decode import StaticDecoder, lane_rows_for
from ar_service.planning import EditLimits, ImagePlan, RequestPlanner
from ar_service.prefill import (
    PREFILL_MEMO_ENTRIES,
    PrefillMemo,
    build_prefix_cache,
    negative_condition_for,
    system_prefix_ids,
)
from ar_service.render_client import RenderHeader, RenderSession
from protos.knobs import KnobTable
from protos.status import RequestRejected
from servicekit import tracing
from servicekit.checkpoint import PipelineCheckpoint
from servicekit.profiling import BusyProfiler, stage

log = logging.getLogger(__name__)

class Renderer(Protocol):
    def open(self, header: RenderHeader, on_event, timeout: float | None = None) -> RenderSession: ...


@dataclass
class Job:
    plan: ImagePlan
    mode: Literal["image", "tokens"]
    deadline: float | None = None  # time.monotonic() value
    events: queue.Queue[object] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.perf_counter)
    trace: Any = None  # the request's trace context (servicekit.tracing); None when tracing is off

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: list[RenderSession] = []
        self._end_sent: dict[int, float] = {}
        self._renders_done = 0
        self._decoding_done = False
        self._finished = False
        self.timings: dict[str, float] = {}
        # engine bookkeeping (worker thread only, except _wake)
        self._wake: Callable[[], None] | None = None  # set by the engine: called when the job is cancelled or fails
        self._streams_left = self.plan.n
        self._left_early = False  # counted as cancelled by the engine
        self.negative: torch.Tensor | None = None

    # -- called by the engine and by render reader threads ----------------------------------

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add_timings(self, **values: float) -> None:
        """Adds to the request's timings (summed over its images)."""
        with self._lock:
            for key, value in values.items():
                self.timings[key] = self.timings.get(key, 0) + value

    def set_timings(self, **values: float) -> None:
        """Sets request-wide facts among the timings (the same for every image: not summed)."""
        with self._lock:
            self.timings.update(values)

    def attach(self, session: RenderSession) -> None:
        with self._lock:
            self._sessions.append(session)
        if self.cancelled.is_set():
            session.cancel()

    def end_sent(self, index: int) -> None:
        with self._lock:
            self._end_sent[index] = time.perf_counter()

    def decoding_finished(self) -> None:
        with self._lock:
            self._decoding_done = True
        self._maybe_complete()

    def on_render_event(self, event: object) -> None:
        if isinstance(event, events.ConditionReceived):
            sent = self._end_sent.get(event.index)
            if sent is not None:
                self.add_timings(condition_transfer_ms=(time.perf_counter() - sent) * 1e3)
        elif isinstance(event, events.RenderDone):
            wanted = ("dit_queue_ms", "denoise_ms", "vae_decode_ms", "encode_ms", "preview_ms", "transformer_calls",
                      "dit_steps_computed", "dit_steps_skipped")
            self.add_timings(**{key: event.timings.get(key, 0) for key in wanted})
            with self._lock:
                self._renders_done += 1
            self._maybe_complete()
        elif isinstance(event, events.RenderFailed):
            self.fail(event.error)
        else:
            self.events.put(event)

    def fail(self, error: RequestRejected) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.events.put(events.JobFailed(error))
        self._stop()

    def cancel(self) -> None:
        """The caller went away or its deadline passed: stop decoding and every render."""
        with self._lock:
            self._finished = True
        self._stop()

    def _stop(self) -> None:
        self.cancelled.set()
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.cancel()
        if self._wake is not None:
            self._wake()

    def _maybe_complete(self) -> None:
        with self._lock:
            expected = self.plan.n if self.mode == "image" else 0
            if self._finished or not self._decoding_done or self._renders_done < expected:
                return
            self._finished = True
            timings = dict(self.timings)
        timings["total_ms"] = (time.perf_counter() - self.received_at) * 1e3
        self.events.put(events.JobDone(seed=self.plan.seed, knobs=self.plan.knobs, timings=timings))


class QueueFull(RequestRejected):
    """The waiting queue is full: RESOURCE_EXHAUSTED, with a hint of when to retry."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_s=retry_after_s)


@dataclass
class EngineStatus:
    queued: int
    running: int
    queue_capacity: int
    max_batch_size: int
    admitted_total: int
    rejected_total: int
    cancelled_total: int
    completed_total: int
    largest_batch: int
    batched_steps_total: int


@dataclass
class _Slot:
    """One image of a job in the running batch."""

    job: Job
    index: int
    seed: int
    stream: DecodeStream
    session: RenderSession | None
    joined: float
    decode_span: Any = None  # ar.decode, from joining the batch to the last token (None when tracing is off)


class AREngine:
    """Owns the AR model: plans requests against it and decodes them in a continuously batched loop."""

    def __init__(
        self,
        loaded: LoadedAR,
        checkpoint: PipelineCheckpoint,
        knob_table: KnobTable,
        renderer: Renderer,
        model_id: str | None = None,
        max_prompt_tokens: int = 1024,
        max_pixels: int | None = None,
        edit_limits: EditLimits | None = None,
        max_batch_size: int = 8,
        max_queued_requests: int = 16,
        prefix_cache: bool = True,
        prefill_memo: int = PREFILL_MEMO_ENTRIES,
        metrics: EngineMetrics | None = None,
        decoder: EagerDecoder | SlotDecoder | None = None,
        fast_decode: bool = False,
        compile_decode: bool = False,
        compile_decode_mode: str = "default",
        decode_kernels: str = "torch",
        decode_lookahead: bool = False,
        capture_lane_graphs: bool = False,
        decode_lane_rows: int = 0,
        decode_lane_attention: str = "auto",
        deterministic: bool = False,
        profiler: BusyProfiler | None = None,
        gpu_memory_utilization: float = 0.9,
        device_memory: DeviceMemory | None = None,
    ):
        """``gpu_memory_utilization``: the fraction of the device's total memory this process may hold; the fast
        decoder is sized to fit it (fewer images than ``max_batch_size`` when they do not: ``self.max_batch_size``
        says how many). ``device_memory``: the device's figures to size against (default: read from CUDA; on the
        CPU none, so no limit). ``decode_lane_rows``: the rows a fast decode step of lanes may run
        (``static_decode.lane_rows_for``; 0: auto); ``decode_lane_attention``: how such a step reads its rows'
        slots (``StaticDecoder``'s ``lane_attention``)."""
        if max_batch_size < 1 or max_queued_requests < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queued_requests >= 0")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {gpu_memory_utilization}")
        self.loaded = loaded
        self.checkpoint = checkpoint
        self.serving = checkpoint.serving
        self.knob_table = knob_table
        self.renderer = renderer
        self.planner = RequestPlanner(
            loaded, checkpoint, knob_table, lambda decoding: self.decoder.decodes(decoding), model_id=model_id,
            max_prompt_tokens=max_prompt_tokens, max_pixels=max_pixels, edit_limits=edit_limits,
        )
        self.model_id = self.planner.model_id
        self.ar_defaults = self.planner.ar_defaults
        self.choices = self.planner.choices
        self.max_queued_requests = max_queued_requests
        self.profiler = profiler  # None: no tracing, stage labels are a shared no-op
        # The shared system-prompt prefix: split off every prompt either way (same numbers with or without
        # the cache), computed once when the cache is on.
        self.prefix_ids = system_prefix_ids(loaded.tokenizer)
        self.prefix = build_prefix_cache(loaded.model, self.prefix_ids) if prefix_cache else None
        # Eager: each stream its own cache, padded batch. Fast: fixed slots and an in-place cache sized for the
        # longest request this engine accepts, CUDA graphs on CUDA; deterministic: every step runs every slot
        # (StaticDecoder's full_length) so that no shape depends on the batch-mates (batch-invariant to the bit).
        # Either way there are ROWS_PER_IMAGE rows per image: an AR-guided image decodes an unconditional row too.
        # The fast decoder is sized to the device's memory first (fit_fast_decoder): it may hold fewer images.
        if decoder is None and fast_decode:
            # lanes of speculative and row-parallel decoding read their stream's slot: free with the triton
            # kernels; with the torch ones a gather of the cache per layer, in graphs of their own
            shared_slots = True

            def build(rows: int) -> SlotDecoder:
                static = StaticDecoder(
                    loaded.model, rows, self.max_positions(), compile=compile_decode, full_length=deterministic,
                    compile_mode=compile_decode_mode, kernels=decode_kernels, shared_slots=shared_slots,
                    lane_rows=lane_rows_for(decode_lane_rows, rows, decode_kernels, full_length=deterministic),
                    lane_attention=decode_lane_attention,
                )
                log.info(
                    "fast decode: %d slots x %d positions (%.2f GiB of K/V), steps of lanes up to %d rows (%s), %s "
                    "kernels, %s%s", rows, static.max_positions,
                    (static.k.numel() + static.v.numel()) * static.k.element_size() / 2**30, static.lane_rows,
                    static.lane_read, decode_kernels, "CUDA graphs" if static.cuda_graphs else "no CUDA graphs",
                    ", compiled" if compile_decode else "",
                )
                started = time.perf_counter()
                default = self.planner.grid_rule.grid(self.serving.default_width, self.serving.default_height)
                typical = len(prompt_ids_for(loaded.tokenizer, "", default)) + min(256, max_prompt_tokens)
                graphs = static.warm_up(typical + default.decode_tokens, lanes=capture_lane_graphs)
                if graphs:
                    log.info("fast decode: %d CUDA graphs captured in %.1f s", graphs, time.perf_counter() - started)
                static.lookahead = decode_lookahead
                return SlotDecoder(static)

            decoder, max_batch_size = self.fit_fast_decoder(
                max_batch_size, build, kernels=decode_kernels, shared_slots=shared_slots, device_memory=device_memory,
                utilization=gpu_memory_utilization, lane_rows=decode_lane_rows, full_length=deterministic,
            )
        self.decoder = decoder or EagerDecoder(loaded.model, ROWS_PER_IMAGE * max_batch_size)
        self.max_batch_size = max_batch_size  # what the decoder holds: admission, status and metrics follow it
        self.metrics = metrics or EngineMetrics(max_batch_size)
        # Negative prompts' conditions and guided images' unconditional rows, kept by their ids (0: none kept).
        self.memo = PrefillMemo(prefill_memo, self.metrics.count_prefill_memo) if prefill_memo > 0 else None
        default_mode = self.ar_defaults.get("ar_decoding", SEQUENTIAL)
        if not self.decoder.decodes(Decoding(default_mode)):
            raise ValueError(f"the checkpoint's default ar_decoding {default_mode!r} cannot run on this server's "
                             "fast decoder")
        self._lock = threading.RLock()  # re-entered when a cancel inside the worker wakes the worker
        self._wake = threading.Condition(self._lock)
        self._waiting: deque[Job] = deque()  # admitted, not started (guarded by _lock)
        self._pending: deque[tuple[Job, int]] = deque()  # images of started jobs waiting for a slot (worker only)
        self._running: list[_Slot] = []  # worker only; len() read for the status
        self._closed = False
        self._counts = dict(admitted=0, rejected=0, cancelled=0, completed=0, largest=0, batched_steps=0)
        self._seconds_per_image = 1.0  # running estimate of one image's decode wall time, for retry-after
        # On a GPU the worker issues its work on a stream of the highest priority, so that where the DiT shares the
        # card (one GPU under CUDA MPS) the decode step's short kernels are scheduled ahead of the denoise's waiting
        # ones. Measured at saturation (bench/results/h200/NOTES.md): alone it changed nothing at 16 clients; the
        # gain came from capping the DiT's share of the SMs, which was measured with this priority in place.
        device = next(loaded.model.parameters()).device
        self._stream = torch.cuda.Stream(device, priority=-100) if device.type == "cuda" else None
        self._worker = threading.Thread(target=self._work, name="ar-worker", daemon=True)
        self._worker.start()

    def fit_fast_decoder(
        self,
        images: int,
        build: Callable[[int], SlotDecoder],
        *,
        kernels: str,
        shared_slots: bool,
        device_memory: DeviceMemory | None,
        utilization: float,
        lane_rows: int = 0,
        full_length: bool = False,
    ) -> tuple[SlotDecoder, int]:
        """``build(rows)`` for ``images`` images, or for as many as the device's memory holds (docs/ar_batching.md,
        "Decode memory"): sized before anything is allocated against ``utilization`` of the device (``device_memory``,
        or CUDA's figures read now; none on the CPU), then, should building or capturing the graphs still run out of
        memory, built again with half the images, down to one. Returns the decoder and its images; raises
        ``DecodeMemoryError`` when not even one image fits."""
        model, config = self.loaded.model, self.loaded.config
        positions = self.max_positions()
        dtype_bytes = model.dtype.itemsize
        per_slot = decode_bytes_per_slot(config, positions, dtype_bytes)
        fp8 = any(getattr(m, "weight_scale", None) is not None for m in model.modules())

        def workspace(rows: int) -> int:
            """Of a decoder of ``rows`` slots: its widest step is one of lanes when they may be wider."""
            widest = lane_rows_for(lane_rows, rows, kernels, full_length) if shared_slots else rows
            return decode_workspace_bytes(config, widest, positions, dtype_bytes=dtype_bytes,
                                          shared_slots=shared_slots, kernels=kernels, fp8=fp8)

        def one_image() -> str:
            rows = ROWS_PER_IMAGE
            return (f"one image ({rows} decode slots x {positions} positions) needs {format_bytes(rows * per_slot)} "
                    f"of K/V and {format_bytes(workspace(rows))} of step workspace")

        remedy = ("raise gpu_memory_utilization (ARDIT_AR_GPU_MEMORY_UTILIZATION) or shorten the decode cache with a "
                  "lower max_pixels or max_prompt_tokens")
        cuda = model.device.type == "cuda"
        memory = device_memory
        if memory is None and cuda:
            torch.cuda.empty_cache()  # what the allocator keeps cached from the load is this process's to use
            memory = cuda_memory(model.device)
            # The share is a limit too, from here on: past it this process's allocations fail (and the decoder is
            # built again smaller, below), not those of a dit_service on the same GPU.
            torch.cuda.set_per_process_memory_fraction(utilization, model.device)
        if memory is not None:
            available = memory.budget(utilization)
            try:
                fit = fit_batch(images, ROWS_PER_IMAGE, per_slot, workspace, available)
            except DecodeMemoryError as exc:
                raise DecodeMemoryError(
                    f"ar_service cannot hold the decode memory of even one image: {one_image()} "
                    f"({format_bytes(exc.needed)}), and {format_bytes(available)} is available "
                    f"({memory.describe(utilization)}); {remedy}", exc.needed, available,
                ) from None
            if fit.shrunk:
                asked = ROWS_PER_IMAGE * images
                log.warning(
                    "decode memory: max_batch_size %d does not fit: %d images need %s (%d slots x %d positions of K/V "
                    "at %s a slot, plus %s of step workspace), and %s is available (%s); max_batch_size %d instead "
                    "(%s)", images, images, format_bytes(fit.requested_needed), asked, positions, format_bytes(per_slot),
                    format_bytes(workspace(asked)), format_bytes(available), memory.describe(utilization), fit.images,
                    format_bytes(fit.needed),
                )
            images = fit.images
        while True:
            try:
                built = build(ROWS_PER_IMAGE * images)
                if cuda:
                    torch.cuda.empty_cache()  # the capture's eager warm-up runs kept their blocks cached
                return built, images
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            # Out of the except block, its traceback (and the half-built decoder its frames hold) is gone.
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            if images == 1:
                raise DecodeMemoryError(
                    f"ar_service ran out of GPU memory building its fast decoder for one image ({error}): "
                    f"{one_image()}; {remedy}", ROWS_PER_IMAGE * per_slot + workspace(ROWS_PER_IMAGE),
                    memory.budget(utilization) if memory is not None else 0,
                )
            log.warning("decode memory: building the fast decoder for %d images (%d slots) ran out of memory (%s); "
                        "building it for %d", images, ROWS_PER_IMAGE * images, error, images // 2)
            images //= 2

    def max_positions(self) -> int:
        """The planner's ``max_positions``: what the fast decoder's cache must hold."""
        return self.planner.max_positions()

    def model_card(self) -> dict[str, Any]:
        return self.planner.model_card()

    def plan(self, **request: Any) -> ImagePlan:
        """The planner's ``plan`` (ar_service/planning.py), for callers that hold only the engine."""
        return self.planner.plan(**request)

    # -- admission and status --------------------------------------------------------------

    def submit(
        self, plan: ImagePlan, mode: Literal["image", "tokens"] = "image", timeout: float | None = None, trace: Any = None
    ) -> Job:
        """Queues a request (FIFO); raises QueueFull at once when ``max_queued_requests`` already wait.

        ``trace``: the request's trace context; the stage spans (prefill, decode, render) open under it."""
        job = Job(plan=plan, mode=mode, deadline=None if timeout is None else time.monotonic() + timeout, trace=trace)
        job._wake = self._notify
        with self._lock:
            if self._closed:
                raise RequestRejected("ar_service is shutting down", code=grpc.StatusCode.UNAVAILABLE)
            if len(self._waiting) >= self.max_queued_requests:
                self._counts["rejected"] += 1
                self.metrics.rejected.inc()
                retry = self._retry_after_locked()
                raise QueueFull(
                    f"ar_service is at capacity: {len(self._waiting)} requests queued, {len(self._running)} images "
                    f"decoding (max batch {self.max_batch_size}); retry in about {retry} s",
                    retry,
                )
            self._waiting.append(job)
            self._counts["admitted"] += 1
            self.metrics.admitted.inc()
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()
        return job

    def _retry_after_locked(self) -> int:
        images = sum(job.plan.n for job in self._waiting) + len(self._pending) + len(self._running)
        return max(1, math.ceil(self._seconds_per_image * images / self.max_batch_size))

    def status(self) -> EngineStatus:
        with self._lock:
            c = self._counts
            return EngineStatus(
                queued=len(self._waiting),
                running=len(self._running),
                queue_capacity=self.max_queued_requests,
                max_batch_size=self.max_batch_size,
                admitted_total=c["admitted"],
                rejected_total=c["rejected"],
                cancelled_total=c["cancelled"],
                completed_total=c["completed"],
                largest_batch=c["largest"],
                batched_steps_total=c["batched_steps"],
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()

    def _notify(self) -> None:
        with self._lock:
            self._wake.notify()

    # -- the worker loop -------------------------------------------------------------------------

    def _work(self) -> None:
        if self._stream is not None:  # what the start-up (warm-up, graph capture) queued comes first
            self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
        with torch.cuda.stream(self._stream):  # None (CPU): no-op
            self._serve()

    def _serve(self) -> None:
        while True:
            if self.profiler is not None and not (self._pending or self._running or self._waiting):
                self.profiler.idle()  # a busy period ended: its trace is written
            with self._lock:
                while not self._closed and not self._waiting and not self._pending and not self._running:
                    self._wake.wait()
                if self._closed:
                    break
                first = self._waiting[0].plan.request_id if self._waiting else ""
            if self.profiler is not None:
                self.profiler.busy(first)  # no-op while a trace is already recording
            try:
                with torch.inference_mode():
                    self._drop_left()
                    self._admit()
                    if self._running:
                        self._step()
            except Exception as exc:  # the worker must outlive any one batch
                log.exception("AR decode step failed")
                for slot in list(self._running):
                    self._fail(slot.job, RequestRejected(f"AR decode failed: {type(exc).__name__}", code=grpc.StatusCode.INTERNAL))
        for slot in list(self._running):
            slot.job.cancel()
        self._running.clear()
        if self.profiler is not None:
            self.profiler.idle()

    def _set_running(self, slots: list[_Slot]) -> None:
        """The one place streams leave the batch: whatever is dropped gives its decoder slot back."""
        staying = {id(slot) for slot in slots}
        for slot in self._running:
            if id(slot) not in staying:
                self.decoder.release(slot.stream)
                tracing.end_span(slot.decode_span, "left the batch early")  # a finished slot ended its span already
                slot.decode_span = None
        with self._lock:
            self._running = slots
        self.metrics.running.set(len(slots))

    def _leave(self, job: Job) -> None:
        """Takes every image of ``job`` out of the batch and the pending list, freeing their caches."""
        self._set_running([slot for slot in self._running if slot.job is not job])
        if any(j is job for j, _ in self._pending):
            self._pending = deque(entry for entry in self._pending if entry[0] is not job)

    def _left_early(self, job: Job) -> None:
        """``job`` was cancelled, passed its deadline or failed: out of the batch, counted once."""
        self._leave(job)
        if not job._left_early:
            job._left_early = True
            with self._lock:
                self._counts["cancelled"] += 1
            self.metrics.cancelled.inc()
            log.info("request %s left the AR batch early", job.plan.request_id)

    def _fail(self, job: Job, error: RequestRejected) -> None:
        job.fail(error)
        self._left_early(job)

    def _expired(self, job: Job) -> bool:
        if job.cancelled.is_set():
            return True
        if job.deadline is not None and time.monotonic() >= job.deadline:
            job.cancel()  # the RPC's own deadline ends it too; this stops the work within one token
            return True
        return False

    def _drop_left(self) -> None:
        """Removes cancelled and expired requests: from the queue, the pending images and the batch."""
        with self._lock:
            gone = [job for job in self._waiting if self._expired(job)]
            if gone:
                self._waiting = deque(job for job in self._waiting if job not in gone)
                self.metrics.queue_depth.set(len(self._waiting))
        for job in gone:
            self._left_early(job)
        for job in {id(j): j for j, _ in self._pending}.values():
            if self._expired(job):
                self._left_early(job)
        for job in {id(s.job): s.job for s in self._running}.values():
            if self._expired(job):
                self._left_early(job)

    def _admit(self) -> None:
        """Fills free slots: images of started jobs first, then the next queued job (FIFO); prefills each."""
        while len(self._running) < self.max_batch_size:
            if not self._pending:
                with self._lock:
                    job = self._waiting.popleft() if self._waiting else None
                    self.metrics.queue_depth.set(len(self._waiting))
                if job is None:
                    return
                if self._expired(job):
                    self._left_early(job)
                    continue
                if not self._start_job(job):
                    continue
            job, index = self._pending.popleft()
            try:
                slot = self._open(job, index)
            except RequestRejected as exc:
                self._fail(job, exc)
                continue
            except Exception as exc:
                log.exception("request %s: prefill failed", job.plan.request_id)
                self._fail(job, RequestRejected(f"AR prefill failed: {type(exc).__name__}", code=grpc.StatusCode.INTERNAL))
                continue
            self._set_running([*self._running, slot])

    def _start_job(self, job: Job) -> bool:
        plan = job.plan
        try:
            if plan.negative_ids is not None and job.mode == "image":
                with stage(self.profiler, "ar.prefill"), tracing.span("ar.prefill", job.trace, prompt="negative"):
                    job.negative, prefill_ms = negative_condition_for(
                        self.loaded.model, plan.negative_ids, prefix_ids=self.prefix_ids, prefix=self.prefix,
                        memo=self.memo,
                    )
                job.add_timings(ar_prefill_ms=prefill_ms)
        except Exception as exc:
            log.exception("request %s: negative prefill failed", plan.request_id)
            self._fail(job, RequestRejected(f"AR prefill failed: {type(exc).__name__}", code=grpc.StatusCode.INTERNAL))
            return False
        self._pending.extend((job, i) for i in range(plan.n))
        return True

    def _open(self, job: Job, index: int) -> _Slot:
        plan, config = job.plan, self.loaded.config
        seed = plan.seed + index
        session = None
        if job.mode == "image":
            header = RenderHeader(
                request_id=plan.request_id,
                index=index,
                width=plan.width // plan.upscale,
                height=plan.height // plan.upscale,
                upscale=plan.upscale,
                seed=seed,
                output_format=plan.output_format,
                output_compression=plan.output_compression,
                knobs=plan.dit_knobs,
                hidden_size=config.hidden_size,
                dtype=str(self.loaded.model.dtype).removeprefix("torch."),
                text_positions=plan.text_positions,
                image_positions=plan.image_positions,
                negative_positions=0 if job.negative is None else job.negative.shape[0],
                partial_images=plan.partial_images,
                references=plan.references,
            )
            with tracing.use(job.trace):  # the render's span and its traceparent hang under the request's
                session = self.renderer.open(header, job.on_render_event, timeout=job.remaining())
            job.attach(session)
            if job.negative is not None:
                session.send_condition("negative", 0, job.negative)
        with stage(self.profiler, "ar.prefill"), tracing.span("ar.prefill", job.trace, image_index=index):
            stream = DecodeStream(
                self.loaded.model,
                plan.prompt_ids,
                plan.grid,
                self.choices.t2i,
                plan.sampling,
                seed,
                on_row=self._row_handler(job, index, seed, session),
                prefix_ids=self.prefix_ids,
                prefix=self.prefix,
                reserve=self.decoder.reserve,
                guidance=plan.guidance,
                condition_scope=self.choices.condition_scope,
                image_end_id=self.choices.image_end_id,
                on_window=None if session is None else self._window_handler(job, session),
                memo=self.memo,
                decoding=plan.decoding,
            )
        job.add_timings(ar_prefill_ms=stream.prefill_ms)
        if session is not None:
            session.send_condition("text", 0, stream.text_condition)
            if stream.lead_condition.shape[0]:  # prompt_tail: the image condition's rows from the prompt
                session.send_condition("image", 0, stream.lead_condition)
        self.decoder.admit(stream)
        decode_span = tracing.start_span("ar.decode", job.trace, image_index=index, grid_rows=plan.grid.height)
        return _Slot(job, index, seed, stream, session, time.perf_counter(), decode_span)

    def _step(self) -> None:
        """One token for every running stream: sample, then one batched forward for those that go on."""
        start = time.perf_counter()
        size = len(self._running)
        feed: list[_Slot] = []
        for slot in list(self._running):
            if slot.job.cancelled.is_set():
                continue  # failed in this step already
            try:
                with stage(self.profiler, "ar.sample"):
                    more = slot.stream.sample()
            except ConditionLengthError as exc:
                log.error("request %s: %s", slot.job.plan.request_id, exc)
                self._fail(slot.job, RequestRejected(f"AR condition is malformed: {exc}", code=grpc.StatusCode.INTERNAL))
                continue
            if more:
                feed.append(slot)
            else:
                self._finish(slot)
        feed = [slot for slot in feed if not slot.job.cancelled.is_set()]
        if feed:
            with stage(self.profiler, "ar.decode_step"):
                shares = self.decoder.step([slot.stream for slot in feed])
            for slot, share in zip(feed, shares, strict=True):
                if slot.job.cancelled.is_set():
                    continue
                try:
                    committed = slot.stream.advance(share)
                    self.metrics.count_forward(slot.stream.decoding.mode, committed)
                except ConditionLengthError as exc:
                    log.error("request %s: %s", slot.job.plan.request_id, exc)
                    self._fail(slot.job, RequestRejected(f"AR condition is malformed: {exc}", code=grpc.StatusCode.INTERNAL))
        self.metrics.batch_size.observe(size)
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        with self._lock:
            self._counts["largest"] = max(self._counts["largest"], size)
            if size > 1:
                self._counts["batched_steps"] += 1

    def _finish(self, slot: _Slot) -> None:
        job, stream = slot.job, slot.stream
        decode_s = time.perf_counter() - slot.joined
        tracing.end_span(slot.decode_span, tokens=len(stream.tokens))
        slot.decode_span = None
        self._set_running([s for s in self._running if s is not slot])
        job.add_timings(ar_decode_ms=decode_s * 1e3, ar_tokens=len(stream.tokens), ar_forwards=stream.forwards)
        job.set_timings(ar_grid_width=job.plan.grid.width, ar_grid_height=job.plan.grid.height)
        self.metrics.tokens_per_forward.labels(stream.decoding.mode).observe(len(stream.tokens) / max(1, stream.forwards))
        if slot.session is not None:
            slot.session.finish()
            job.end_sent(slot.index)
        with self._lock:
            self._seconds_per_image = 0.8 * self._seconds_per_image + 0.2 * decode_s
        job._streams_left -= 1
        if job._streams_left == 0:
            with self._lock:
                self._counts["completed"] += 1
            self.metrics.completed.inc()
            job.decoding_finished()

    def _window_handler(self, job: Job, session: RenderSession):
        """Sends what the fed ``<|image end|>`` completes: the answer window (at 0), or prompt_tail's last row."""
        offset = 0
        if self.choices.condition_scope == PROMPT_TAIL:
            offset = job.plan.image_positions - 1

        def on_window(hidden: torch.Tensor) -> None:
            session.send_condition("image", offset, hidden)

        return on_window

    def _row_handler(self, job: Job, index: int, seed: int, session: RenderSession | None):
        grid = job.plan.grid
        lead = grid_condition_offset(job.plan.prompt_ids, self.choices.condition_scope, self.loaded.config)

        def on_row(row: int, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
            if session is not None:
                if self.choices.condition_scope != ANSWER_WINDOW:  # the answer window goes at the end (on_window)
                    session.send_condition("image", lead + grid.row_start(row), hidden)
            else:
                ids = [int(t) for t in token_ids[: grid.width]]
                job.events.put(events.TokenRow(index, seed, grid.width, grid.height, row, ids))
            job.events.put(events.Progress(index, "ar_decode", row + 1, grid.height))

        return on_row
