"""The AR side of the Render stream: a gRPC client that the engine feeds row by row.

The engine sees only ``RenderSession`` (send_condition / finish / cancel) and receives
ar_service.events objects through a callback; the proto and grpc details stay here.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from ar_service import events
from protos import channels, common_pb2, dit_pb2, dit_pb2_grpc
from protos.codec import encode_tensor, iter_row_chunks
from protos.formats import format_enum, format_name
from protos.status import RequestRejected, effective_code, param_of, retry_after_of
from protos.values import knobs_to_proto
from servicekit import tracing
from servicekit.checkpoint import ModelIdentity
from servicekit.tls import ClientTLS, open_channel

log = logging.getLogger(__name__)

KINDS = {"text": dit_pb2.CONDITION_KIND_TEXT, "image": dit_pb2.CONDITION_KIND_IMAGE, "negative": dit_pb2.CONDITION_KIND_NEGATIVE}
_CLOSE = object()


#: Bytes of an image file per ``ImageChunk``: well under the 4 MiB message default with the envelope.
IMAGE_CHUNK_BYTES = 3 * 1024 * 1024


def reference_pieces(images: tuple[bytes, ...] | list[bytes], chunk: int = IMAGE_CHUNK_BYTES) -> list[common_pb2.ImageChunk]:
    """Each image's file as ``ImageChunk`` pieces of at most ``chunk`` bytes, numbered from 0, the last of each marked."""
    pieces = []
    for index, data in enumerate(images):
        starts = range(0, max(len(data), 1), chunk)
        for start in starts:
            last = start + chunk >= len(data)
            pieces.append(common_pb2.ImageChunk(index=index, data=data[start:start + chunk], last=last))
    return pieces


@dataclass(frozen=True)
class RenderHeader:
    request_id: str
    index: int
    width: int  # what the DiT renders; its pictures come back upscale times as large
    height: int
    seed: int
    output_format: str
    output_compression: int | None
    knobs: dict[str, Any]
    hidden_size: int
    dtype: str
    text_positions: int
    image_positions: int
    negative_positions: int
    partial_images: int = 0
    model: ModelIdentity | None = None  # the AR's model, for the DiT to check the condition is of its own
    upscale: int = 1
    #: An edit's input images (encoded files, in the client's order): sent as ``RenderInput.reference`` pieces after
    #: the header; the DiT encodes its reference latents from them and renders the last one's size.
    references: tuple[bytes, ...] = ()

    def to_proto(self) -> dit_pb2.RenderHeader:
        header = dit_pb2.RenderHeader(
            request_id=self.request_id,
            width=self.width,
            height=self.height,
            n=1,
            seed=self.seed,
            output_format=format_enum(self.output_format),
            knobs=knobs_to_proto(self.knobs),
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            text_positions=self.text_positions,
            image_positions=self.image_positions,
            negative_positions=self.negative_positions,
            index_offset=self.index,
            partial_images=self.partial_images,
            upscale=self.upscale,
            reference_images=len(self.references),
        )
        if self.output_compression is not None:
            header.output_compression = self.output_compression
        if self.model is not None:
            header.model.CopyFrom(common_pb2.ModelIdentity(name=self.model.name, fingerprint=self.model.fingerprint))
        return header


#: A Render stream that fails before the renderer answered (refused for load, or its replica died) is tried again
#: by the rules of the channels' retry policy: a new call, which round_robin gives the next ready replica, replays
#: everything sent so far. gRPC's own retries stay off on the Render channel: a client stream that gRPC retried was
#: seen to lose messages sent around the failure (grpcio 1.85), which the renderer can only report as malformed.
_RETRYABLE = tuple(getattr(grpc.StatusCode, name) for name in channels.RETRYABLE_STATUS_CODES)
#: The copy kept for a replay stops growing here; a stream past it that fails before its answer is not retried.
REPLAY_LIMIT_BYTES = 256 * 1024 * 1024


class RenderSession:
    """One open Render stream: the engine pushes condition pieces, events come back on a thread.

    Until the renderer's first answer, the session keeps what it sent, so that a refused or broken attempt can be
    replayed whole on another replica (``channels.RETRY_ATTEMPTS`` calls in all); after it, a failure is final: a render that started is
    never run twice. Traced as one ``ar.render`` span (kind CLIENT) under the current context, from open to the
    stream's end; the channel's interceptor sends it to dit_service as each attempt's traceparent.
    """

    def __init__(
        self,
        stub: dit_pb2_grpc.RendererStub,
        header: RenderHeader,
        on_event: Callable[[object], None],
        timeout: float | None,
        attempts: int = channels.RETRY_ATTEMPTS,
        on_fault: Callable[[str], None] | None = None,
    ):
        self.index = header.index
        self.request_id = header.request_id
        self._stub = stub
        self._on_event = on_event
        self._on_fault = on_fault  # told of a refusal no retry can mend (another model), and "" on completion
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._max_attempts = attempts
        self.attempts = 0  # calls opened so far
        self._lock = threading.Lock()  # the outbox, call and replay copy change together on a retry
        self._replay: list[dit_pb2.RenderInput] | None = []  # what a new attempt resends; None once answered
        self._replay_bytes = 0
        self._finished = False  # the end marker was queued
        self._cancelled = False
        self._answered = False  # the renderer sent something: the call is committed to its replica
        self._completed = False  # the renderer sent its ``completed`` event
        self._span = tracing.start_span(
            "ar.render", kind="client", request_id=header.request_id, image_index=header.index, seed=header.seed
        )
        with self._lock:
            self._outbox: queue.Queue[Any] = queue.Queue()
            self._put(dit_pb2.RenderInput(header=header.to_proto()))
            for piece in reference_pieces(header.references):
                self._put(dit_pb2.RenderInput(reference=piece))
            self._call = self._start_attempt(timeout)
        self._reader = threading.Thread(target=self._read, name=f"render-{header.request_id}-{header.index}", daemon=True)
        self._reader.start()

    def send_condition(self, kind: str, offset: int, hidden) -> None:
        """Queues [positions, hidden] states of ``kind`` starting at ``offset``, in chunks under 4 MiB."""
        for start, piece in iter_row_chunks(hidden):
            chunk = dit_pb2.ConditionChunk(kind=KINDS[kind], offset=offset + start, hidden_states=encode_tensor(piece))
            with self._lock:
                self._put(dit_pb2.RenderInput(chunk=chunk))

    def finish(self) -> None:
        with self._lock:
            self._put(dit_pb2.RenderInput(end=dit_pb2.RenderEnd()))
            self._finished = True
            self._outbox.put(_CLOSE)

    def cancel(self) -> None:
        """Ends the stream early; nothing to do once the renderer reported completion (its OK status is on the
        way, and a cancel racing it would mark a finished render as cancelled)."""
        with self._lock:
            if self._completed:
                return
            self._cancelled = True
            self._call.cancel()
            self._outbox.put(_CLOSE)

    def _put(self, message: dit_pb2.RenderInput) -> None:
        """Sends ``message`` on the current attempt and keeps it for a replay (the caller holds the lock)."""
        self._outbox.put(message)
        if self._replay is not None:
            self._replay.append(message)
            self._replay_bytes += message.ByteSize()
            if self._replay_bytes > REPLAY_LIMIT_BYTES:
                self._replay = None

    def _start_attempt(self, timeout: float | None) -> grpc.Call:
        """Opens a call fed by the current outbox (the caller holds the lock)."""
        self.attempts += 1
        with tracing.use(tracing.context_of(self._span)):
            return self._stub.Render(iter(self._outbox.get, _CLOSE), timeout=timeout)

    def _retry(self, error: grpc.RpcError) -> bool:
        """Opens the next attempt, replaying what was sent, if ``error`` came before any answer and may pass."""
        code = effective_code(error)
        if code not in _RETRYABLE or self.attempts >= self._max_attempts:
            return False
        time.sleep(random.uniform(0, channels.RETRY_BACKOFF_S))
        with self._lock:
            remaining = None if self._deadline is None else self._deadline - time.monotonic()
            if self._cancelled or self._answered or self._replay is None or (remaining is not None and remaining <= 0):
                return False
            self._outbox.put(_CLOSE)  # frees the failed attempt's sender
            self._outbox = queue.Queue()
            for message in self._replay:
                self._outbox.put(message)
            if self._finished:
                self._outbox.put(_CLOSE)
            log.info("Render of %s image %d failed before an answer (%s: %s); replaying %d messages on a new call",
                     self.request_id, self.index, code.name, error.details(), len(self._replay))
            self._call = self._start_attempt(remaining)
        return True

    def _read(self) -> None:
        error = None
        try:
            while True:
                with self._lock:
                    call = self._call
                try:
                    for event in call:
                        if not self._answered:
                            with self._lock:
                                self._answered = True
                                self._replay = None
                        converted = self._convert(event)
                        if converted is not None:
                            self._on_event(converted)
                    return
                except grpc.RpcError as exc:
                    if not self._retry(exc):
                        raise
        except grpc.RpcError as exc:
            code = effective_code(exc)
            error = f"{code.name}: {exc.details()}"
            if code == grpc.StatusCode.CANCELLED:
                return  # cancelled by us; the engine already knows
            if code == grpc.StatusCode.UNAVAILABLE:
                message = f"dit_service is unavailable: {exc.details()}"
            else:
                message = f"dit_service: {exc.details()}"
            param = param_of(exc)
            if code == grpc.StatusCode.FAILED_PRECONDITION and param == "model" and self._on_fault is not None:
                self._on_fault(message)
            rejected = RequestRejected(message, param, code, retry_after_of(exc))
            self._on_event(events.RenderFailed(self.index, rejected))
        finally:
            tracing.end_span(self._span, error, attempts=self.attempts)

    def _convert(self, event: dit_pb2.RenderEvent) -> object | None:
        kind = event.WhichOneof("event")
        if kind == "progress":
            p = event.progress
            if p.stage == "condition_received":
                return events.ConditionReceived(self.index)
            return events.Progress(p.index, p.stage, p.step, p.total)
        if kind == "image":
            image = event.image
            return events.FinishedImage(
                image.index, image.seed, format_name(image.format), image.data, image.width, image.height
            )
        if kind == "preview":
            p = event.preview
            return events.PreviewImage(
                p.index, p.partial_index, p.step, p.total, format_name(p.format), p.data, p.width, p.height
            )
        if kind == "completed":
            self._completed = True
            if self._on_fault is not None:
                self._on_fault("")
            timings = {f.name: getattr(event.completed.timings, f.name) for f in common_pb2.StageTimings.DESCRIPTOR.fields}
            return events.RenderDone(self.index, timings)
        return None


class GrpcRenderer:
    """Opens Render streams to dit_service over one shared channel.

    ``model``: the AR's model identity, stamped on every header that does not carry one, so that a DiT serving
    another model refuses the render (FAILED_PRECONDITION, param ``model``) before any condition is rendered. The
    last such refusal is kept in ``fault`` (reported by GetStatus and the gateway's /health) until a render completes.
    """

    def __init__(
        self, address: str, timeout: float | None = None, tls: ClientTLS | None = None, model: ModelIdentity | None = None
    ):
        self.address = address
        self.timeout = timeout
        self.model = model
        self.fault = ""
        self._channel = tracing.intercept_channel(open_channel(address, tls, channels.channel_options(retries=False)))
        self._stub = dit_pb2_grpc.RendererStub(self._channel)

    def open(self, header: RenderHeader, on_event: Callable[[object], None], timeout: float | None = None) -> RenderSession:
        if header.model is None and self.model is not None:
            header = replace(header, model=self.model)
        return RenderSession(
            self._stub, header, on_event, timeout if timeout is not None else self.timeout, on_fault=self._set_fault
        )

    def _set_fault(self, fault: str) -> None:
        if fault != self.fault:
            if fault:
                log.error("renders fail: %s", fault)
            else:
                log.info("a render completed: the earlier fault (%s) is over", self.fault)
            self.fault = fault

    def close(self) -> None:
        self._channel.close()



