"""ar_service's gRPC transport: the ImageGenerator service, health and reflection.

Translates requests into engine plans and engine events into ImageEvents; no model math.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from typing import Literal

import grpc

from ar_service import events
from ar_service.engine import AREngine, ImagePlan, Job, QueueFull
from ar_service.planning import EditLimits
from protos import ar_pb2, ar_pb2_grpc, channels, common_pb2
from protos.formats import format_enum, format_name
from protos.status import RequestRejected, abort, abort_rejected
from protos.timings import stage_timings
from protos.values import knobs_from_proto, knobs_to_proto, to_value
from servicekit import tracing
from servicekit.grpc_server import RunningServer, build_grpc_server
from servicekit.tls import ServerTLS

log = logging.getLogger(__name__)

IMAGE_GENERATOR_SERVICE = ar_pb2.DESCRIPTOR.services_by_name["ImageGenerator"].full_name
SPAN_PREFIX = IMAGE_GENERATOR_SERVICE + "/"  # a call's span is named service/method, as gRPC's own tracing does
POLL_SECONDS = 0.1

#: gRPC Python reports a call without a deadline as ~9.2e18 s remaining (the core's infinite future), and a
#: client call cannot carry a deadline past 2262 (int64 nanoseconds since the epoch): passed on as the Render
#: call's timeout, such a value wraps into the past and dit_service answers DEADLINE_EXCEEDED at once. A
#: deadline further away than this is no deadline.
NO_DEADLINE_BEYOND_S = 10 * 365 * 24 * 3600.0


def caller_timeout(context: grpc.ServicerContext) -> float | None:
    """Seconds left before the caller's deadline, or None when the caller set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > NO_DEADLINE_BEYOND_S else remaining


def _image_message(image: events.FinishedImage) -> common_pb2.GeneratedImage:
    return common_pb2.GeneratedImage(
        index=image.index,
        seed=image.seed,
        format=format_enum(image.format),
        data=image.data,
        width=image.width,
        height=image.height,
    )


def _preview_message(preview: events.PreviewImage) -> common_pb2.PreviewImage:
    return common_pb2.PreviewImage(
        index=preview.index,
        partial_index=preview.partial_index,
        step=preview.step,
        total=preview.total,
        format=format_enum(preview.format),
        data=preview.data,
        width=preview.width,
        height=preview.height,
    )


def _started(plan: ImagePlan) -> ar_pb2.StreamStarted:
    """What the request will run with, before any work: StreamImage's first event."""
    negative = len(plan.negative_ids) if plan.negative_ids is not None else 0
    return ar_pb2.StreamStarted(
        request_id=plan.request_id,
        model=plan.model,
        seed=plan.seed,
        width=plan.width,
        height=plan.height,
        n=plan.n,
        knobs=knobs_to_proto(plan.knobs),
        prompt_tokens=len(plan.prompt_ids) + negative,
        image_tokens=plan.grid.decode_tokens,
        grid_rows=plan.grid.height,
    )


def _summary(plan: ImagePlan, done: events.JobDone) -> ar_pb2.GenerateImageResponse:
    timings = stage_timings(done.timings)
    return ar_pb2.GenerateImageResponse(
        request_id=plan.request_id,
        model=plan.model,
        seed=done.seed,
        width=plan.width,
        height=plan.height,
        timings=timings,
        knobs=knobs_to_proto(done.knobs),
    )


class ImageGeneratorServicer(ar_pb2_grpc.ImageGeneratorServicer):
    def __init__(self, engine: AREngine | None = None, log_prompts: bool = False):
        self.engine = engine  # None while the model loads
        self.log_prompts = log_prompts  # off: logs carry prompt lengths, never prompt text

    # -- RPCs -------------------------------------------------------------------------------

    def GenerateImage(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext):
        with tracing.server_span(SPAN_PREFIX + "GenerateImage", context) as span:
            return self._generate_image(request, context, span)

    def _generate_image(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext, span):
        job = self._start(request, context, mode="image", span=span)
        response = None
        images = []
        for event in self._events(job, context):
            if isinstance(event, events.FinishedImage):
                images.append(_image_message(event))
            elif isinstance(event, events.JobDone):
                response = _summary(job.plan, event)
        if response is None:
            abort(context, grpc.StatusCode.CANCELLED, "request cancelled")
        images.sort(key=lambda image: image.index)
        response.images.extend(images)
        return response

    def StreamImage(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext):
        with tracing.server_span(SPAN_PREFIX + "StreamImage", context) as span:
            yield from self._stream_image(request, context, span)

    def _stream_image(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext, span):
        job = self._start(request, context, mode="image", span=span, partial_images=request.partial_images)
        yield from self._image_events(job, context)

    def _image_events(self, job: Job, context: grpc.ServicerContext) -> Iterator[ar_pb2.ImageEvent]:
        """StreamImage's answer (and EditImage's): the plan, then progress, previews, images and the summary."""
        yield ar_pb2.ImageEvent(started=_started(job.plan))
        for event in self._events(job, context):
            if isinstance(event, events.Progress):
                progress = common_pb2.Progress(index=event.index, stage=event.stage, step=event.step, total=event.total)
                yield ar_pb2.ImageEvent(progress=progress)
            elif isinstance(event, events.PreviewImage):
                yield ar_pb2.ImageEvent(preview=_preview_message(event))
            elif isinstance(event, events.FinishedImage):
                yield ar_pb2.ImageEvent(image=_image_message(event))
            elif isinstance(event, events.JobDone):
                yield ar_pb2.ImageEvent(completed=_summary(job.plan, event))

    def EditImage(self, request_iterator: Iterator[ar_pb2.EditImageInput], context: grpc.ServicerContext):
        with tracing.server_span(SPAN_PREFIX + "EditImage", context) as span:
            yield from self._edit_image(request_iterator, context, span)

    def _edit_image(self, request_iterator: Iterator[ar_pb2.EditImageInput], context: grpc.ServicerContext, span):
        engine = self._engine(context)
        try:
            request, images = read_edit_input(request_iterator, engine.planner.edit_limits)
        except RequestRejected as exc:
            abort_rejected(context, exc)
        job = self._start(request, context, mode="image", span=span, partial_images=request.partial_images,
                          images=images)
        yield from self._image_events(job, context)

    def GenerateVisualTokens(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext):
        with tracing.server_span(SPAN_PREFIX + "GenerateVisualTokens", context) as span:
            yield from self._visual_tokens(request, context, span)

    def _visual_tokens(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext, span):
        job = self._start(request, context, mode="tokens", span=span)
        for event in self._events(job, context):
            if isinstance(event, events.TokenRow):
                yield ar_pb2.VisualTokenRow(
                    index=event.index,
                    seed=event.seed,
                    grid_width=event.grid_width,
                    grid_height=event.grid_height,
                    row=event.row,
                    token_ids=event.token_ids,
                )

    def ListModels(self, request: ar_pb2.ListModelsRequest, context: grpc.ServicerContext):
        engine = self._engine(context)
        card = engine.model_card()
        knobs = []
        for entry in card.pop("knobs"):
            knob, default = entry["knob"], entry["default"]
            spec = ar_pb2.KnobSpec(name=knob.name, type=knob.kind, choices=knob.choices, description=knob.description)
            if default is not None:
                spec.default.CopyFrom(to_value(default))
            if knob.minimum is not None:
                spec.minimum = knob.minimum
            if knob.maximum is not None:
                spec.maximum = knob.maximum
            knobs.append(spec)
        grid = ar_pb2.GridRule(**card.pop("grid"))
        return ar_pb2.ListModelsResponse(models=[ar_pb2.ModelCard(knobs=knobs, grid=grid, **card)])

    def GetStatus(self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext):
        engine = self._engine(context)
        status = common_pb2.EngineStatus(**vars(engine.status()))
        status.render_fault = getattr(engine.renderer, "fault", "")  # a renderer that keeps none has none to tell
        return status

    # -- plumbing ---------------------------------------------------------------------------

    def _engine(self, context: grpc.ServicerContext) -> AREngine:
        if self.engine is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "ar_service is still loading its model")
        return self.engine

    def _start(
        self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext, mode: Literal["image", "tokens"], span=None,
        partial_images: int = 0, images: list[bytes] | None = None,
    ) -> Job:
        """Plans and queues a request. ``partial_images`` only from StreamImage: the other calls have no previews to
        send, so the renderer is not asked for any."""
        engine = self._engine(context)
        try:
            plan = engine.plan(
                request_id=request.request_id,
                model=request.model,
                prompt=request.prompt,
                negative_prompt=request.negative_prompt,
                width=request.width,
                height=request.height,
                n=request.n or 1,
                seed=request.seed if request.HasField("seed") else None,
                output_format=format_name(request.output_format),
                output_compression=request.output_compression if request.HasField("output_compression") else None,
                quality=request.quality,
                knobs=knobs_from_proto(request.knobs),
                partial_images=partial_images,
                images=images or (),
            )
        except RequestRejected as exc:
            abort_rejected(context, exc)
        try:
            tracing.set_attributes(
                span, request_id=plan.request_id, n=plan.n, width=plan.width, height=plan.height, seed=plan.seed
            )
            job = engine.submit(plan, mode=mode, timeout=caller_timeout(context), trace=tracing.context_of(span))
        except QueueFull as exc:
            log.warning("request %s refused: %s", plan.request_id, exc.message)
            abort_rejected(context, exc)
        except RequestRejected as exc:
            abort_rejected(context, exc)
        context.add_callback(job.cancel)
        log.info(
            "request %s: %d image(s) %dx%d seed %d, prompt %d tokens%s",
            plan.request_id, plan.n, plan.width, plan.height, plan.seed, len(plan.prompt_ids),
            f", editing {len(plan.references)} input image(s) (MammothTok grids {[g[2:] for g in plan.reference_grids]})"
            if plan.references else "",
        )
        if self.log_prompts:
            log.info("request %s prompt: %r negative: %r", plan.request_id, request.prompt, request.negative_prompt)
        return job

    def _events(self, job: Job, context: grpc.ServicerContext) -> Iterator[object]:
        """The job's events until it is done; a failure ends the RPC with its status."""
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not context.is_active():
                    job.cancel()
                    return
                continue
            if isinstance(event, events.JobFailed):
                abort_rejected(context, event.error)
            yield event
            if isinstance(event, events.JobDone):
                return


def read_edit_input(
    messages: Iterator[ar_pb2.EditImageInput], limits: EditLimits
) -> tuple[ar_pb2.GenerateImageRequest, list[bytes]]:
    """An EditImage call's request and its images' files, put together from their pieces; refuses (INVALID_ARGUMENT)
    a stream that does not start with the request, pieces out of order, an image left unfinished, and files over the
    byte limits as soon as they pass them."""
    request = None
    images: list[bytearray] = []
    open_image = False
    total = 0
    for message in messages:
        kind = message.WhichOneof("input")
        if kind == "request":
            if request is not None:
                raise RequestRejected("EditImage takes one request message, first; got a second", param="request")
            request = message.request
            continue
        if kind != "image":
            raise RequestRejected("EditImage messages carry a request or an image piece; got neither", param="image")
        if request is None:
            raise RequestRejected("EditImage's first message must be the request, before any image piece", param="request")
        piece = message.image
        expected = len(images) - 1 if open_image else len(images)
        if piece.index != expected:
            raise RequestRejected(
                f"image pieces must come in order, each image's pieces together, images numbered from 0: expected a "
                f"piece of image {expected}, got one of image {piece.index}", param="image")
        if not open_image:
            images.append(bytearray())
        images[-1].extend(piece.data)
        total += len(piece.data)
        open_image = not piece.last
        if len(images[-1]) > limits.max_image_bytes:
            raise RequestRejected(f"input image {piece.index} is over {limits.max_image_bytes} bytes, the most accepted",
                                  param="image")
        if total > limits.max_total_bytes:
            raise RequestRejected(f"the input images are over {limits.max_total_bytes} bytes together, the most accepted",
                                  param="image")
    if request is None:
        raise RequestRejected("EditImage got no request message", param="request")
    if open_image:
        raise RequestRejected(f"input image {len(images) - 1} ended without its last piece (last = true)", param="image")
    if not images:
        raise RequestRejected("an edit needs at least one input image; EditImage got none", param="image")
    return request, [bytes(image) for image in images]


def build_server(
    host: str,
    port: int,
    max_workers: int,
    engine: AREngine | None = None,
    *,
    tls: ServerTLS | None = None,
    max_concurrent_streams: int = channels.DEFAULT_MAX_CONCURRENT_STREAMS,
    max_connection_age_s: float = channels.DEFAULT_MAX_CONNECTION_AGE_S,
    max_connection_age_grace_s: float = channels.DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
) -> RunningServer:
    """A bound, not yet started server reporting NOT_SERVING until ``set_serving(True)``."""
    return build_grpc_server(
        "ar_service",
        IMAGE_GENERATOR_SERVICE,
        ImageGeneratorServicer(engine),
        ar_pb2_grpc.add_ImageGeneratorServicer_to_server,
        host,
        port,
        max_workers,
        channels.server_options(
            max_concurrent_streams, max_connection_age_s=max_connection_age_s,
            max_connection_age_grace_s=max_connection_age_grace_s,
        ),
        tls,
    )
