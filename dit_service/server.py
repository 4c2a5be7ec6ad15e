"""dit_service's gRPC transport: the Renderer service, health and reflection.

Turns RenderInput messages into engine calls and engine events into RenderEvents. The
stream protocol is header, condition chunks and reference-image pieces (an edit), end marker; anything else is
INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import grpc

from dit_service.engine import (
    DiTEngine,
    FinishedImage,
    PreviewImage,
    Progress,
    QueueFull,
    RenderDone,
    RenderFailed,
)
from dit_service.model.sampler import DenoiseCancelled
from dit_service.planning import RenderPlan, RenderPlanner
from protos import channels, common_pb2, dit_pb2, dit_pb2_grpc
from protos.codec import CodecError, decode_tensor
from protos.formats import format_enum, format_name
from protos.status import RequestRejected, abort, abort_rejected
from protos.timings import stage_timings
from protos.values import knobs_from_proto, knobs_to_proto
from servicekit import tracing
from servicekit.checkpoint import ModelIdentity
from servicekit.grpc_guard import MalformedMessage
from servicekit.grpc_server import RunningServer, build_grpc_server
from servicekit.tls import ServerTLS

log = logging.getLogger(__name__)

KIND_NAMES = {
    dit_pb2.CONDITION_KIND_TEXT: "text",
    dit_pb2.CONDITION_KIND_IMAGE: "image",
    dit_pb2.CONDITION_KIND_NEGATIVE: "negative",
}


def _plan_from_header(planner: RenderPlanner, header: dit_pb2.RenderHeader) -> RenderPlan:
    return planner.plan(
        request_id=header.request_id,
        width=header.width,
        height=header.height,
        n=header.n or 1,
        seed=header.seed if header.HasField("seed") else None,
        output_format=format_name(header.output_format),
        output_compression=header.output_compression if header.HasField("output_compression") else None,
        knobs=knobs_from_proto(header.knobs),
        hidden_size=header.hidden_size,
        dtype=header.dtype,
        text_positions=header.text_positions,
        image_positions=header.image_positions,
        negative_positions=header.negative_positions,
        index_offset=header.index_offset,
        partial_images=header.partial_images,
        model=ModelIdentity(header.model.name, header.model.fingerprint) if header.HasField("model") else None,
        upscale=header.upscale or 1,
        reference_images=header.reference_images,
    )


def to_render_event(event: object, plan: RenderPlan) -> dit_pb2.RenderEvent:
    if isinstance(event, Progress):
        return dit_pb2.RenderEvent(
            progress=common_pb2.Progress(index=event.index, stage=event.stage, step=event.step, total=event.total)
        )
    if isinstance(event, FinishedImage):
        return dit_pb2.RenderEvent(
            image=common_pb2.GeneratedImage(
                index=event.index,
                seed=event.seed,
                format=format_enum(event.format),
                data=event.data,
                width=event.width,
                height=event.height,
            )
        )
    if isinstance(event, PreviewImage):
        return dit_pb2.RenderEvent(
            preview=common_pb2.PreviewImage(
                index=event.index,
                partial_index=event.partial_index,
                step=event.step,
                total=event.total,
                format=format_enum(event.format),
                data=event.data,
                width=event.width,
                height=event.height,
            )
        )
    assert isinstance(event, RenderDone)
    timings = stage_timings(event.timings)
    return dit_pb2.RenderEvent(
        completed=dit_pb2.RenderSummary(
            request_id=plan.request_id, seed=event.seed, timings=timings, knobs=knobs_to_proto(event.knobs)
        )
    )


class RendererServicer(dit_pb2_grpc.RendererServicer):
    def __init__(self, engine: DiTEngine | None = None):
        self.engine = engine  # None while the model loads

    def Render(self, request_iterator: Iterator[dit_pb2.RenderInput], context: grpc.ServicerContext):
        with tracing.server_span(RENDER_SPAN, context) as span:
            yield from self._render(request_iterator, context, span)

    def _render(self, request_iterator: Iterator[dit_pb2.RenderInput], context: grpc.ServicerContext, span):
        if self.engine is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "dit_service is still loading its model")
        try:
            first = next(request_iterator, None)
        except RequestRejected as exc:  # the first message did not decode
            abort_rejected(context, exc)
        if first is None or first.WhichOneof("input") != "header":
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a Render stream must start with a header", param="header")
        try:
            plan = _plan_from_header(self.engine.planner, first.header)
        except RequestRejected as exc:
            abort_rejected(context, exc)
        try:
            self.engine.admit()  # a full queue refuses at once, before any condition is streamed
        except QueueFull as exc:
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), retry_after_s=exc.retry_after_s)
        tracing.set_attributes(span, request_id=plan.request_id, n=plan.n, width=plan.width, height=plan.height, seed=plan.seed)
        job = None
        try:
            job = self._receive_condition(plan, request_iterator, context, tracing.context_of(span))
        except RequestRejected as exc:
            abort_rejected(context, exc)
        except CodecError as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), param="chunk.hidden_states")
        finally:
            if job is None:  # the stream failed before its end marker: give the slot back
                self.engine.withdraw(cancelled=not context.is_active())
        # Caller gone or deadline passed: the render leaves the batch within one step. A call that already ended
        # runs no callback, hence the check; a generator closed early (the stream ended) cancels in ``finally``.
        if not context.add_callback(job.cancel):
            job.cancel()
        try:
            # The condition is complete: tell the caller (it measures the transfer), then render.
            yield dit_pb2.RenderEvent(progress=common_pb2.Progress(stage="condition_received", total=plan.n))
            violation = self._watch_for_trailing_messages(request_iterator, job)
            while True:
                try:
                    event = job.events.get(timeout=0.1)
                except queue.Empty:
                    event = None
                if violation.is_set():
                    abort(context, grpc.StatusCode.INVALID_ARGUMENT, "messages arrived after the end marker", param="end")
                if isinstance(event, RenderFailed):
                    if isinstance(event.error, DenoiseCancelled):
                        abort(context, grpc.StatusCode.CANCELLED, "render cancelled")
                    abort(context, grpc.StatusCode.INTERNAL, f"render failed: {type(event.error).__name__}")
                if event is None:
                    continue
                yield to_render_event(event, plan)
                if isinstance(event, RenderDone):
                    return
        finally:
            job.cancel()  # a no-op once the render is done

    def GetStatus(self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext) -> common_pb2.EngineStatus:
        if self.engine is None:
            abort(context, grpc.StatusCode.UNAVAILABLE, "dit_service is still loading its model")
        return common_pb2.EngineStatus(**self.engine.status())

    def _receive_condition(self, plan: RenderPlan, request_iterator, context, trace=None):
        """Reads chunks until the end marker; returns the queued job (traced under ``trace``)."""
        engine = self.engine
        assert engine is not None, "Render refuses calls while the model loads"
        assembler = engine.assembler(plan)
        for message in request_iterator:
            kind = message.WhichOneof("input")
            if kind == "chunk":
                chunk = message.chunk
                tensor = chunk.hidden_states
                kind_name = KIND_NAMES.get(chunk.kind, "unspecified")
                assembler.precheck(kind_name, chunk.offset, tensor.dtype, list(tensor.shape), len(tensor.data))
                assembler.add(KIND_NAMES.get(chunk.kind, "unspecified"), chunk.offset, decode_tensor(chunk.hidden_states))
            elif kind == "reference":
                piece = message.reference
                assembler.add_reference_piece(piece.index, piece.data, piece.last)
            elif kind == "end":
                condition, uncond = assembler.complete()
                references = assembler.complete_references()  # decoded here, off the engine's worker
                return engine.submit(plan, condition, uncond, admitted=True, trace=trace, references=references)
            else:
                raise RequestRejected(f"unexpected {kind or 'empty'} message inside a Render stream", param=kind or "input")
        if not context.is_active():
            abort(context, grpc.StatusCode.CANCELLED, "caller went away before the end marker")
        raise RequestRejected("the Render stream closed without an end marker", param="end")

    @staticmethod
    def _watch_for_trailing_messages(request_iterator, job) -> threading.Event:
        """Anything the caller sends after the end marker is a protocol error: cancel the render."""
        violation = threading.Event()

        def watch() -> None:
            try:
                for _ in request_iterator:
                    violation.set()
                    job.cancel()
                    return
            except MalformedMessage:  # an undecodable message after the end marker: a violation too
                violation.set()
                job.cancel()
            except Exception:  # the stream ended with the RPC; nothing to report
                pass

        threading.Thread(target=watch, name="render-trailing-watch", daemon=True).start()
        return violation


RENDERER_SERVICE = dit_pb2.DESCRIPTOR.services_by_name["Renderer"].full_name
RENDER_SPAN = RENDERER_SERVICE + "/Render"  # a call's span is named service/method, as gRPC's own tracing does


def build_server(
    host: str,
    port: int,
    max_workers: int,
    engine: DiTEngine | None = None,
    *,
    tls: ServerTLS | None = None,
    max_concurrent_streams: int = channels.DEFAULT_MAX_CONCURRENT_STREAMS,
    max_connection_age_s: float = channels.DEFAULT_MAX_CONNECTION_AGE_S,
    max_connection_age_grace_s: float = channels.DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
    max_receive_message_bytes: int = channels.MAX_MESSAGE_BYTES,
) -> RunningServer:
    """A bound, not yet started server reporting NOT_SERVING until ``set_serving(True)``."""
    return build_grpc_server(
        "dit_service",
        RENDERER_SERVICE,
        RendererServicer(engine),
        dit_pb2_grpc.add_RendererServicer_to_server,
        host,
        port,
        max_workers,
        channels.server_options(
            max_concurrent_streams, max_receive_message_bytes, max_connection_age_s, max_connection_age_grace_s
        ),
        tls,
    )
