"""dit_service's engine: checks a render, assembles its condition, runs it on one worker.

Sits between the gRPC transport (server.py) and the model (model/): no grpc here, no
model math in the transport. One worker thread owns the GPU/CPU; renders wait in a FIFO
queue and their time there is reported as ``dit_queue_ms``.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dit_service.imaging import encode_image
from dit_service.model.pipeline import DiTPipeline
from dit_service.model.sampler import DenoiseCancelled
from protos.knobs import KnobTable
from protos.status import RequestRejected

log = logging.getLogger(__name__)

FORMATS = ("png", "jpeg", "webp")
CONDITION_KINDS = ("text", "image", "negative")
MAX_IMAGES = 10


@dataclass(frozen=True)
class Progress:
    index: int
    stage: str
    step: int
    total: int


@dataclass(frozen=True)
class FinishedImage:
    index: int
    seed: int
    format: str
    data: bytes
    width: int
    height: int


@dataclass(frozen=True)
class RenderDone:
    seed: int
    knobs: dict[str, Any]
    timings: dict[str, float]


@dataclass(frozen=True)
class RenderFailed:
    error: BaseException


@dataclass
class RenderPlan:
    """A checked render request, before its condition has arrived."""

    request_id: str
    width: int
    height: int
    n: int
    seed: int
    output_format: str
    output_compression: int | None
    knobs: dict[str, Any]
    hidden_size: int
    dtype: torch.dtype
    positions: dict[str, int]
    index_offset: int = 0


class ConditionAssembler:
    """Collects condition chunks into buffers preallocated from the plan, checking each one."""

    def __init__(self, plan: RenderPlan):
        self.plan = plan
        self.buffers = {
            kind: torch.empty((count, plan.hidden_size), dtype=plan.dtype) for kind, count in plan.positions.items()
        }
        self.filled = {kind: torch.zeros(count, dtype=torch.bool) for kind, count in plan.positions.items()}

    def add(self, kind: str, offset: int, hidden: torch.Tensor) -> None:
        if kind not in CONDITION_KINDS:
            raise RequestRejected(f"condition chunk kind must be one of {', '.join(CONDITION_KINDS)}", param="chunk.kind")
        if hidden.dtype != self.plan.dtype:
            raise RequestRejected(
                f"condition chunk dtype {str(hidden.dtype).removeprefix('torch.')} differs from the header's "
                f"{str(self.plan.dtype).removeprefix('torch.')}",
                param="chunk.hidden_states",
            )
        if hidden.dim() != 2 or hidden.shape[1] != self.plan.hidden_size or hidden.shape[0] == 0:
            raise RequestRejected(
                f"condition chunk shape must be [positions >= 1, {self.plan.hidden_size}]; got {list(hidden.shape)}",
                param="chunk.hidden_states",
            )
        declared = self.plan.positions[kind]
        end = offset + hidden.shape[0]
        if end > declared:
            raise RequestRejected(
                f"{kind} condition chunk covers positions {offset}..{end - 1}, but the header declared {declared}",
                param="chunk.offset",
            )
        if bool(self.filled[kind][offset:end].any()):
            raise RequestRejected(f"{kind} condition positions {offset}..{end - 1} were sent twice", param="chunk.offset")
        self.buffers[kind][offset:end] = hidden
        self.filled[kind][offset:end] = True

    def complete(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(condition, unconditional condition) once every declared position has arrived."""
        for kind, filled in self.filled.items():
            missing = int((~filled).sum())
            if missing:
                raise RequestRejected(f"{missing} declared {kind} condition positions never arrived", param="chunk")
        condition = torch.cat([self.buffers["text"], self.buffers["image"]], dim=0)
        return condition, self.buffers["negative"]


@dataclass
class RenderJob:
    plan: RenderPlan
    condition: torch.Tensor
    uncond: torch.Tensor
    events: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    condition_complete_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()


class DiTEngine:
    """Plans renders against the loaded pipeline and runs them one at a time, in arrival order."""

    def __init__(self, pipeline: DiTPipeline, knob_table: KnobTable, max_condition_positions: int):
        self.pipeline = pipeline
        self.knob_table = knob_table
        self.max_condition_positions = max_condition_positions
        self._jobs: "queue.Queue[RenderJob | None]" = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="dit-worker", daemon=True)
        self._worker.start()

    # -- planning -------------------------------------------------------------------------

    def plan(
        self,
        *,
        request_id: str,
        width: int,
        height: int,
        n: int,
        seed: int | None,
        output_format: str,
        output_compression: int | None,
        knobs: dict[str, Any],
        hidden_size: int,
        dtype: str,
        text_positions: int,
        image_positions: int,
        negative_positions: int,
        index_offset: int = 0,
    ) -> RenderPlan:
        """Checks a render header; raises RequestRejected naming the field at fault."""
        multiple = self.pipeline.size_multiple
        for name, side in (("width", width), ("height", height)):
            if side <= 0 or side % multiple:
                raise RequestRejected(f"{name} must be a positive multiple of {multiple}; got {side}", param=name)
        if not 1 <= n <= MAX_IMAGES:
            raise RequestRejected(f"n must be between 1 and {MAX_IMAGES}; got {n}", param="n")
        if output_format not in FORMATS:
            raise RequestRejected(f"output_format must be one of {', '.join(FORMATS)}", param="output_format")
        if output_compression is not None:
            if output_format == "png":
                raise RequestRejected("output_compression applies to jpeg and webp only", param="output_compression")
            if not 0 <= output_compression <= 100:
                raise RequestRejected("output_compression must be between 0 and 100", param="output_compression")
        if hidden_size != self.pipeline.condition_dim:
            raise RequestRejected(
                f"hidden_size must be {self.pipeline.condition_dim} for this model; got {hidden_size}", param="hidden_size"
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise RequestRejected(f"condition dtype must be float32, bfloat16 or float16; got {dtype!r}", param="dtype")
        positions = {"text": text_positions, "image": image_positions, "negative": negative_positions}
        if text_positions + image_positions == 0:
            raise RequestRejected("the condition is empty: declare text or image positions", param="text_positions")
        if sum(positions.values()) > self.max_condition_positions:
            raise RequestRejected(
                f"the header declares {sum(positions.values())} condition positions; at most "
                f"{self.max_condition_positions} are accepted",
                param="image_positions",
            )
        resolved = self.knob_table.resolve(knobs, {}, stages=("dit",))
        return RenderPlan(
            request_id=request_id or f"render-{secrets.token_hex(8)}",
            width=width,
            height=height,
            n=n,
            seed=secrets.randbelow(2**32) if seed is None else seed,
            output_format=output_format,
            output_compression=output_compression,
            knobs=resolved,
            hidden_size=hidden_size,
            dtype=getattr(torch, dtype),
            positions=positions,
            index_offset=index_offset,
        )

    # -- running --------------------------------------------------------------------------

    def submit(self, plan: RenderPlan, condition: torch.Tensor, uncond: torch.Tensor) -> RenderJob:
        job = RenderJob(plan=plan, condition=condition, uncond=uncond)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                job.events.put(RenderFailed(DenoiseCancelled("render cancelled before it started")))
                continue
            try:
                self._render(job)
            except BaseException as exc:  # the worker must outlive any one render
                if not isinstance(exc, DenoiseCancelled):
                    log.exception("render %s failed", job.plan.request_id)
                job.events.put(RenderFailed(exc))

    def _render(self, job: RenderJob) -> None:
        plan = job.plan
        started = time.perf_counter()
        timings = {"dit_queue_ms": (started - job.condition_complete_at) * 1e3}
        totals = {"denoise_ms": 0.0, "vae_decode_ms": 0.0, "encode_ms": 0.0, "transformer_calls": 0}
        steps = plan.knobs["num_inference_steps"]
        for i in range(plan.n):
            index = plan.index_offset + i
            seed = plan.seed + i
            t0 = time.perf_counter()
            result = self.pipeline.render_latents(
                condition=job.condition,
                uncond_condition=job.uncond,
                width=plan.width,
                height=plan.height,
                seed=seed,
                steps=steps,
                guidance=plan.knobs["text_guidance_scale"],
                cfg_range=tuple(plan.knobs["cfg_range"]),
                on_step=lambda step, total, index=index: job.events.put(Progress(index, "denoise", step, total)),
                should_stop=job.cancelled.is_set,
            )
            t1 = time.perf_counter()
            pixels = self.pipeline.decode(result.latents)
            t2 = time.perf_counter()
            data = encode_image(pixels, plan.output_format, plan.output_compression)
            t3 = time.perf_counter()
            totals["denoise_ms"] += (t1 - t0) * 1e3
            totals["vae_decode_ms"] += (t2 - t1) * 1e3
            totals["encode_ms"] += (t3 - t2) * 1e3
            totals["transformer_calls"] += result.transformer_calls
            job.events.put(FinishedImage(index, seed, plan.output_format, data, plan.width, plan.height))
        timings.update(totals)
        timings["total_ms"] = (time.perf_counter() - job.condition_complete_at) * 1e3
        job.events.put(RenderDone(seed=plan.seed, knobs=plan.knobs, timings=timings))
