"""ar_service's gRPC transport: the ImageGenerator service, health and reflection.

Translates requests into engine plans and engine events into ImageEvents; no model math.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator

import grpc

from ar_service import events
from ar_service.engine import AREngine, ImagePlan, Job, QueueFull
from protos import ar_pb2, ar_pb2_grpc, channels, common_pb2
from protos.formats import format_enum, format_name
from protos.status import RequestRejected, abort, abort_rejected
from protos.values import knobs_from_proto, knobs_to_proto, to_value
from servicekit.grpc_server import RunningServer, build_grpc_server
from servicekit.tls import ServerTLS

log = logging.getLogger(__name__)

IMAGE_GENERATOR_SERVICE = ar_pb2.DESCRIPTOR.services_by_name["ImageGenerator"].full_name
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


def _summary(plan: ImagePlan, done: events.JobDone) -> ar_pb2.GenerateImageResponse:
    timings = common_pb2.StageTimings(
        **{f.name: done.timings.get(f.name, 0) for f in common_pb2.StageTimings.DESCRIPTOR.fields}
    )
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
        job = self._start(request, context, mode="image")
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
        job = self._start(request, context, mode="image")
        for event in self._events(job, context):
            if isinstance(event, events.Progress):
                progress = common_pb2.Progress(index=event.index, stage=event.stage, step=event.step, total=event.total)
                yield ar_pb2.ImageEvent(progress=progress)
            elif isinstance(event, events.FinishedImage):
                yield ar_pb2.ImageEvent(image=_image_message(event))
            elif isinstance(event, events.JobDone):
                yield ar_pb2.ImageEvent(completed=_summary(job.plan, event))

    def GenerateVisualTokens(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext):
        job = self._start(request, context, mode="tokens")
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
        return ar_pb2.ListModelsResponse(models=[ar_pb2.ModelCard(knobs=knobs, **card)])

    def GetStatus(self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext):
        status = self._engine(context).status()
        return common_pb2.EngineStatus(**vars(status))

    # -- plumbing ---------------------------------------------------------------------------

    def _engine(self, context: grpc.ServicerContext) -> AREngine:
        if self.engine is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "ar_service is still loading its model")
        return self.engine

    def _start(self, request: ar_pb2.GenerateImageRequest, context: grpc.ServicerContext, mode: str) -> Job:
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
            )
        except RequestRejected as exc:
            abort_rejected(context, exc)
        try:
            job = engine.submit(plan, mode=mode, timeout=caller_timeout(context))
        except QueueFull as exc:
            log.warning("request %s refused: %s", plan.request_id, exc.message)
            abort_rejected(context, exc)
        except RequestRejected as exc:
            abort_rejected(context, exc)
        context.add_callback(job.cancel)
        log.info(
            "request %s: %d image(s) %dx%d seed %d, prompt %d tokens",
            plan.request_id, plan.n, plan.width, plan.height, plan.seed, len(plan.prompt_ids),
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
