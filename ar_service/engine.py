"""ar_service's engine: checks a request, decodes each image's grid, streams it to the renderer.

Between the gRPC transport (server.py) and the model (model/, generation.py). One worker
thread owns the AR model and takes requests in arrival order. For image i of a request it
opens a Render stream (seed + i), sends the prompt's text condition after prefill, then
every grid row as soon as it is decoded, so that the transfer is done when the last row
is; it then moves on to the next image while the renderer works on this one.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import grpc
import torch

from ar_service import events
from ar_service.generation import (
    ConditionLengthError,
    GenerationCancelled,
    generate_grid,
    prompt_ids_for,
    text_condition_for,
    text_condition_mask,
)
from ar_service.model.loading import LoadedAR
from ar_service.prompt import Grid, grid_for_size
from ar_service.render_client import RenderHeader, RenderSession
from ar_service.sampling import SamplingParams
from protos.knobs import KnobTable
from protos.status import RequestRejected
from servicekit.checkpoint import PipelineCheckpoint

log = logging.getLogger(__name__)

MAX_IMAGES = 10
FORMATS = ("png", "jpeg", "webp")
QUALITIES = ("", "auto", "low", "medium", "high", "standard", "hd")


class Renderer(Protocol):
    def open(self, header: RenderHeader, on_event, timeout: float | None = None) -> RenderSession: ...


@dataclass
class ImagePlan:
    """A checked request: everything the worker needs, nothing left to validate."""

    request_id: str
    model: str
    prompt_ids: list[int]
    negative_ids: list[int] | None
    grid: Grid
    width: int
    height: int
    n: int
    seed: int
    output_format: str
    output_compression: int | None
    sampling: SamplingParams
    dit_knobs: dict[str, Any]
    knobs: dict[str, Any]  # every knob the request runs with, defaults filled in
    text_positions: int


@dataclass
class Job:
    plan: ImagePlan
    mode: Literal["image", "tokens"]
    deadline: float | None = None  # time.monotonic() value
    events: "queue.Queue[object]" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: list[RenderSession] = []
        self._end_sent: dict[int, float] = {}
        self._renders_done = 0
        self._decoding_done = False
        self._finished = False
        self.timings: dict[str, float] = {}

    # -- called by the engine and by render reader threads ----------------------------------

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add_timings(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self.timings[key] = self.timings.get(key, 0) + value

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
            wanted = ("dit_queue_ms", "denoise_ms", "vae_decode_ms", "encode_ms", "transformer_calls")
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

    def _maybe_complete(self) -> None:
        with self._lock:
            expected = self.plan.n if self.mode == "image" else 0
            if self._finished or not self._decoding_done or self._renders_done < expected:
                return
            self._finished = True
            timings = dict(self.timings)
        timings["total_ms"] = (time.perf_counter() - self.received_at) * 1e3
        self.events.put(events.JobDone(seed=self.plan.seed, knobs=self.plan.knobs, timings=timings))


class AREngine:
    """Owns the AR model: plans requests against it and decodes them one at a time."""

    def __init__(
        self,
        loaded: LoadedAR,
        checkpoint: PipelineCheckpoint,
        knob_table: KnobTable,
        renderer: Renderer,
        model_id: str | None = None,
        max_prompt_tokens: int = 1024,
        max_pixels: int | None = None,
    ):
        self.loaded = loaded
        self.checkpoint = checkpoint
        self.serving = checkpoint.serving
        self.knob_table = knob_table
        self.renderer = renderer
        self.model_id = model_id or checkpoint.name
        self.max_prompt_tokens = max_prompt_tokens
        self.max_pixels = max_pixels  # None: the largest side squared is the only bound
        # Pixels per visual token is a serving fact (ardit_serving.json, default 16 as vllm-omni), not a model one.
        self.pixels_per_token = checkpoint.serving.pixels_per_token
        self.size_multiple = math.lcm(self.pixels_per_token, checkpoint.size_multiple)
        t2i = loaded.t2i
        self.ar_defaults = {"temperature": t2i.default_temperature, "top_k": t2i.top_k, "top_p": t2i.top_p}
        # Strings the tokenizer turns into control tokens: inside a prompt they would rewrite the envelope.
        self._control_tokens = tuple(sorted(loaded.tokenizer.get_added_vocab(), key=len, reverse=True))
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="ar-worker", daemon=True)
        self._worker.start()

    # -- the model card ---------------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        knobs = []
        for knob in self.knob_table.knobs:
            default = self.ar_defaults.get(knob.name, knob.default)
            knobs.append({"knob": knob, "default": default})
        return {
            "id": self.model_id,
            "family": self.checkpoint.family,
            "default_width": self.serving.default_width,
            "default_height": self.serving.default_height,
            "max_side": self.serving.max_side,
            "size_multiple": self.size_multiple,
            "max_prompt_tokens": self.max_prompt_tokens,
            "knobs": knobs,
            "quality_steps": dict(self.knob_table.quality_steps),
        }

    # -- planning ---------------------------------------------------------------------------

    def plan(
        self,
        *,
        request_id: str = "",
        model: str = "",
        prompt: str,
        negative_prompt: str = "",
        width: int = 0,
        height: int = 0,
        n: int = 1,
        seed: int | None = None,
        output_format: str = "png",
        output_compression: int | None = None,
        quality: str = "",
        knobs: dict[str, Any] | None = None,
    ) -> ImagePlan:
        """Checks a request against the model; raises RequestRejected naming the parameter at fault."""
        if model and model != self.model_id:
            raise RequestRejected(
                f"model '{model}' is not served here; served models: {self.model_id}",
                param="model",
                code=grpc.StatusCode.NOT_FOUND,
            )
        if not prompt or not prompt.strip():
            raise RequestRejected("'prompt' must be a non-empty string", param="prompt")
        if not 1 <= n <= MAX_IMAGES:
            raise RequestRejected(f"'n' must be between 1 and {MAX_IMAGES}; got {n}", param="n")
        width, height = self._check_size(width, height)
        if output_format not in FORMATS:
            raise RequestRejected(f"'output_format' must be one of {', '.join(FORMATS)}", param="output_format")
        if output_compression is not None:
            if output_format == "png":
                raise RequestRejected("'output_compression' applies to jpeg and webp only", param="output_compression")
            if not 0 <= output_compression <= 100:
                raise RequestRejected("'output_compression' must be between 0 and 100", param="output_compression")
        if quality not in QUALITIES:
            raise RequestRejected(f"'quality' must be one of {', '.join(q for q in QUALITIES if q)}", param="quality")

        given = self.knob_table.validate(knobs or {})
        if "seed" in given:
            if seed is not None and seed != given["seed"]:
                raise RequestRejected("'seed' given twice with different values", param="seed")
            seed = given.pop("seed")
        if seed is None:
            seed = secrets.randbelow(2**32)
        elif not 0 <= seed < 2**63:
            raise RequestRejected("'seed' must be between 0 and 2**63 - 1", param="seed")
        ar_given = {k: v for k, v in given.items() if k in self.knob_table.names(("ar",))}
        dit_given = {k: v for k, v in given.items() if k in self.knob_table.names(("dit",))}
        ar_knobs = self.knob_table.resolve(ar_given, self.ar_defaults, stages=("ar",))
        preset = self.knob_table.steps_for_quality(quality)
        if preset is not None and "num_inference_steps" not in dit_given:
            dit_given["num_inference_steps"] = preset
        dit_knobs = self.knob_table.resolve(dit_given, {}, stages=("dit",))

        grid = grid_for_size(width, height, self.pixels_per_token)
        prompt_ids = self._prompt_ids(prompt, grid, "prompt")
        negative_ids = self._prompt_ids(negative_prompt, grid, "negative_prompt") if negative_prompt.strip() else None
        longest = max(len(prompt_ids), len(negative_ids or ()))
        if longest + grid.decode_tokens > self.loaded.config.max_position_embeddings:
            raise RequestRejected(
                f"prompt and a {grid.width}x{grid.height}-token grid need {longest + grid.decode_tokens} positions; "
                f"the model holds {self.loaded.config.max_position_embeddings}: shorten the prompt or the size",
                param="size",
            )
        text_positions = int(text_condition_mask(prompt_ids, self.loaded.config).sum())
        return ImagePlan(
            request_id=request_id or f"img-{uuid.uuid4().hex}",
            model=self.model_id,
            prompt_ids=prompt_ids,
            negative_ids=negative_ids,
            grid=grid,
            width=width,
            height=height,
            n=n,
            seed=seed,
            output_format=output_format,
            output_compression=output_compression,
            sampling=SamplingParams(ar_knobs["temperature"], ar_knobs["top_k"], ar_knobs["top_p"]),
            dit_knobs=dit_knobs,
            knobs={**ar_knobs, **dit_knobs},
            text_positions=text_positions,
        )

    def _check_size(self, width: int, height: int) -> tuple[int, int]:
        if width == 0 and height == 0:
            return self.serving.default_width, self.serving.default_height
        limit, multiple = self.serving.max_side, self.size_multiple
        for side in (width, height):
            if side < multiple or side > limit or side % multiple:
                raise RequestRejected(
                    f"'size' {width}x{height} is not accepted: width and height must be multiples of {multiple} "
                    f"between {multiple} and {limit}",
                    param="size",
                )
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise RequestRejected(
                f"'size' {width}x{height} is {width * height} pixels; at most {self.max_pixels} per image are accepted",
                param="size",
            )
        return width, height

    def _prompt_ids(self, text: str, grid: Grid, param: str) -> list[int]:
        for token in self._control_tokens:
            if token in text:
                raise RequestRejected(f"'{param}' must not contain the model's control token {token!r}", param=param)
        count = len(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
        if count > self.max_prompt_tokens:
            raise RequestRejected(
                f"'{param}' is {count} tokens long; at most {self.max_prompt_tokens} are accepted", param=param
            )
        return prompt_ids_for(self.loaded.tokenizer, text, grid)

    # -- running ----------------------------------------------------------------------------

    def submit(self, plan: ImagePlan, mode: Literal["image", "tokens"] = "image", timeout: float | None = None) -> Job:
        job = Job(plan=plan, mode=mode, deadline=None if timeout is None else time.monotonic() + timeout)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            try:
                with torch.inference_mode():
                    self._run(job)
                job.decoding_finished()
            except GenerationCancelled:
                log.info("request %s cancelled during decode", job.plan.request_id)
            except RequestRejected as exc:
                job.fail(exc)
            except ConditionLengthError as exc:
                log.error("request %s: %s", job.plan.request_id, exc)
                job.fail(RequestRejected(f"AR condition is malformed: {exc}", code=grpc.StatusCode.INTERNAL))
            except Exception as exc:  # the worker must outlive any one request
                log.exception("request %s failed", job.plan.request_id)
                job.fail(RequestRejected(f"AR decode failed: {type(exc).__name__}", code=grpc.StatusCode.INTERNAL))

    def _run(self, job: Job) -> None:
        plan, model, config = job.plan, self.loaded.model, self.loaded.config
        negative = None
        if plan.negative_ids is not None and job.mode == "image":
            negative, prefill_ms = text_condition_for(model, plan.negative_ids, config)
            job.add_timings(ar_prefill_ms=prefill_ms)
        dtype = str(self.loaded.model.dtype).removeprefix("torch.")
        for i in range(plan.n):
            seed = plan.seed + i
            session = None
            if job.mode == "image":
                header = RenderHeader(
                    request_id=plan.request_id,
                    index=i,
                    width=plan.width,
                    height=plan.height,
                    seed=seed,
                    output_format=plan.output_format,
                    output_compression=plan.output_compression,
                    knobs=plan.dit_knobs,
                    hidden_size=config.hidden_size,
                    dtype=dtype,
                    text_positions=plan.text_positions,
                    image_positions=plan.grid.condition_positions,
                    negative_positions=0 if negative is None else negative.shape[0],
                )
                session = self.renderer.open(header, job.on_render_event, timeout=job.remaining())
                job.attach(session)
                if negative is not None:
                    session.send_condition("negative", 0, negative)
            result = generate_grid(
                model,
                plan.prompt_ids,
                plan.grid,
                self.loaded.t2i,
                plan.sampling,
                seed,
                on_prefill=None if session is None else (lambda text, s=session: s.send_condition("text", 0, text)),
                on_row=self._row_handler(job, i, seed, session),
                should_stop=job.cancelled.is_set,
            )
            job.add_timings(ar_prefill_ms=result.prefill_ms, ar_decode_ms=result.decode_ms, ar_tokens=len(result.token_ids))
            if session is not None:
                session.finish()
                job.end_sent(i)

    def _row_handler(self, job: Job, index: int, seed: int, session: RenderSession | None):
        grid = job.plan.grid

        def on_row(row: int, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
            if session is not None:
                session.send_condition("image", grid.row_start(row), hidden)
            else:
                ids = [int(t) for t in token_ids[: grid.width]]
                job.events.put(events.TokenRow(index, seed, grid.width, grid.height, row, ids))
            job.events.put(events.Progress(index, "ar_decode", row + 1, grid.height))

        return on_row
