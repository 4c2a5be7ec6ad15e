"""``stream: true`` on ``POST /v1/images/generations`` and ``/v1/images/edits``: server-sent events, as OpenAI
streams images (edits name their events ``image_edit.*`` instead of ``image_generation.*``).

The events the official clients parse (``openai/types/image_gen_*_event.py``):

- ``event: image_generation.partial_image``: ``type``, ``b64_json``, ``partial_image_index``, ``created_at``, ``size``,
  ``quality``, ``background``, ``output_format``; ardit adds ``image_index`` (which of the n images) and ``step``;
- ``event: image_generation.completed``: the same fields without ``partial_image_index``, plus ``usage``; ardit adds
  ``image_index`` and ``seed``;
- ``data: [DONE]`` after the last image; a failure after the stream has started is one ``event: error`` whose data is
  OpenAI's error shape ``{"error": {message, type, param, code}}`` (the openai client raises it as ``APIError``), and
  the stream then ends cleanly.

Everything else travels as SSE comments (lines starting with ``:``), which every SSE parser skips: the openai client
does not skip unknown event names (it parses the data of any event as an image event), so progress cannot be an
event of its own. Comments are ``: ardit.started {json}`` at once, ``: ardit.progress {json}`` per grid row of the AR
and per denoising step, ``: ardit.completed {json}`` (seeds, timings, knobs; both name the fields given without effect,
as ``ignored_fields``, which the response header ``X-Ardit-Ignored-Fields`` also lists) before ``[DONE]``, and
``: keep-alive`` whenever nothing else was sent for ``sse_keepalive_s``, so that no proxy sees an idle connection.

The gateway waits for ar_service's first event (``started``, sent once the request is planned and queued) before it
answers: a request ar_service refuses still gets its HTTP status (400, 404, 429, ...) like a non-streamed one. A
client that goes away cancels the gRPC call, and with it the AR decode and the denoise, within one step.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway import errors, json_body, translate
from gateway.errors import APIError
from gateway.protocol import ImageGenerationRequest
from protos import ar_pb2
from protos.values import knobs_from_proto

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
_END = object()  # the gRPC stream ended
#: Event name prefixes: generations' (``image_generation.*``) and edits' (``image_edit.*``, openai-python's
#: ``image_edit_partial_image_event.py`` and ``image_edit_completed_event.py``).
GENERATION_EVENTS = "image_generation"
EDIT_EVENTS = "image_edit"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    return b"".join((b"event: ", name.encode(), b"\ndata: ", json_body.dumps(payload), b"\n\n"))


def sse_comment(name: str, payload: dict[str, Any]) -> bytes:
    return b"".join((b": ", name.encode(), b" ", json_body.dumps(payload), b"\n\n"))


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read: only http.disconnect remains)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Pump:
    """Reads the gRPC stream on a task of its own into a queue, so that waiting for the next event can give up for a
    keep-alive without cancelling the read; the stream's end or failure is queued as the last item."""

    def __init__(self, call: Any):
        self.call = call
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run())
        self._getter: asyncio.Future[Any] | None = None

    async def _run(self) -> None:
        try:
            async for event in self.call:
                await self.queue.put(event)
            await self.queue.put(_END)
        except grpc.aio.AioRpcError as exc:
            await self.queue.put(exc)

    async def next(self, timeout: float | None) -> Any:
        """The next item, or None when ``timeout`` passed first (the pending read is kept for the next call)."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not done:
            return None
        item, self._getter = self._getter.result(), None
        return item

    def close(self) -> None:
        """Stops everything: the gRPC call (cancelling the request upstream if it still runs) and the reader."""
        if self._getter is not None:
            self._getter.cancel()
        if not self.task.done():
            self.call.cancel()
            self.task.cancel()


class ImageStream:
    """Turns ar_service's ImageEvents into OpenAI's image stream events (one per preview and per image)."""

    def __init__(self, request: ImageGenerationRequest, started: ar_pb2.StreamStarted, ar_address: str,
                 event_prefix: str = GENERATION_EVENTS):
        self.request = request
        self.partial_event = f"{event_prefix}.partial_image"
        self.completed_event = f"{event_prefix}.completed"
        self.started = started
        self.ar_address = ar_address
        self.size = f"{started.width}x{started.height}"
        self.usage = {
            "input_tokens": started.prompt_tokens,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": started.prompt_tokens},
            "output_tokens": started.image_tokens,
            "total_tokens": started.prompt_tokens + started.image_tokens,
        }
        self.seeds: dict[int, int] = {}

    def _common(self) -> dict[str, Any]:
        return {
            "created_at": int(time.time()),
            "size": self.size,
            "quality": self.request.quality,
            "background": "opaque",
            "output_format": self.request.output_format,
        }

    def opening(self) -> bytes:
        s = self.started
        return sse_comment("ardit.started", {
            "request_id": s.request_id, "model": s.model, "seed": s.seed, "n": s.n, "size": self.size,
            "grid_rows": s.grid_rows, "knobs": knobs_from_proto(s.knobs), "ignored_fields": self.request.ignored_fields(),
        })

    def translate(self, event: ar_pb2.ImageEvent) -> bytes | None:
        kind = event.WhichOneof("event")
        if kind == "progress":
            p = event.progress
            return sse_comment("ardit.progress", {"image_index": p.index, "stage": p.stage, "step": p.step, "total": p.total})
        if kind == "preview":
            p = event.preview
            return sse_event(self.partial_event, {
                "type": self.partial_event,
                "b64_json": base64.b64encode(p.data).decode("ascii"),
                "partial_image_index": p.partial_index,
                **self._common(),
                "image_index": p.index,
                "step": p.step,
            })
        if kind == "image":
            image = event.image
            self.seeds[image.index] = image.seed
            return sse_event(self.completed_event, {
                "type": self.completed_event,
                "b64_json": base64.b64encode(image.data).decode("ascii"),
                **self._common(),
                "usage": self.usage,
                "image_index": image.index,
                "seed": image.seed,
            })
        if kind == "completed":
            summary = event.completed
            return sse_comment("ardit.completed", {
                "request_id": summary.request_id, "model": summary.model, "seed": summary.seed, "size": self.size,
                "seeds": [self.seeds[i] for i in sorted(self.seeds)],
                "timings": translate.timings_to_dict(summary.timings), "knobs": knobs_from_proto(summary.knobs),
                "ignored_fields": self.request.ignored_fields(),
            })
        return None  # a kind this gateway does not know yet: nothing to tell the client

    def error(self, failure: APIError) -> bytes:
        return sse_event("error", errors.error_body(failure.message, failure.status, failure.param, failure.code))

    def failure_of(self, item: Any) -> APIError:
        if isinstance(item, grpc.aio.AioRpcError):
            return errors.from_rpc_error(item, self.ar_address)
        return APIError(502, "ar_service ended the stream without a final result", code="bad_gateway")


async def open_stream(
    request: Request, parsed: ImageGenerationRequest, message: ar_pb2.GenerateImageRequest, call: Any = None,
    event_prefix: str = GENERATION_EVENTS,
) -> StreamingResponse:
    """Starts the gRPC stream (StreamImage of ``message``, or ``call`` when given: an EditImage call) and answers
    with SSE once ar_service has accepted the request (see the module doc)."""
    settings = request.app.state.settings
    if call is None:
        call = request.app.state.generator.StreamImage(message, timeout=settings.request_timeout_s)
    pump = _Pump(call)
    first = asyncio.ensure_future(pump.next(None))
    watching = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({first, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if first not in done:
        first.cancel()
        pump.close()
        raise APIError(499, "the client closed the request", code="client_closed_request")
    item = first.result()
    if isinstance(item, grpc.aio.AioRpcError):
        raise item  # the status ar_service refused with, mapped by errors
    if item is _END or item.WhichOneof("event") != "started":
        pump.close()
        raise APIError(502, "ar_service did not start the stream with its plan", code="bad_gateway")
    stream = ImageStream(parsed, item.started, settings.ar_address, event_prefix)
    return StreamingResponse(
        _body(stream, pump, settings.sse_keepalive_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **translate.ignored_fields_headers(parsed)},
    )


async def _body(stream: ImageStream, pump: _Pump, keepalive_s: float) -> AsyncIterator[bytes]:
    """The SSE body. A client that disconnects cancels this generator (Starlette), and ``finally`` cancels the call."""
    try:
        yield stream.opening()
        while True:
            item = await pump.next(keepalive_s)
            if item is None:
                yield KEEPALIVE
                continue
            if item is _END or isinstance(item, grpc.aio.AioRpcError):
                yield stream.error(stream.failure_of(item))
                return
            chunk = stream.translate(item)
            if chunk is not None:
                yield chunk
            if item.WhichOneof("event") == "completed":
                yield DONE
                return
    finally:
        pump.close()
