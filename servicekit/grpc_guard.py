"""A server interceptor that turns undecodable request bytes into a clean INVALID_ARGUMENT.

gRPC Python answers a request whose bytes do not parse as the method's message with INTERNAL
("Exception deserializing request!"). That is the caller's fault, not the server's, so every
ardit server installs this interceptor: a unary request that does not parse ends the call with
INVALID_ARGUMENT; in a request stream the bad message raises ``MalformedMessage`` (a
``RequestRejected``) where the servicer reads it, and the servicer ends the call the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from protos.status import RequestRejected, abort


class MalformedMessage(RequestRejected):
    def __init__(self, detail: str):
        super().__init__(f"a request message could not be decoded: {detail}", param="input")


class _Undecodable:
    __slots__ = ("detail",)

    def __init__(self, detail: str):
        self.detail = detail


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything a parser raises on garbage
            return _Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

    return parse


def _checked_stream(requests: Iterator[Any]) -> Iterator[Any]:
    for message in requests:
        if isinstance(message, _Undecodable):
            raise MalformedMessage(message.detail)
        yield message


def _unary_behavior(behavior: Callable[..., Any]) -> Callable[..., Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be decoded: {request.detail}", "input")
        return behavior(request, context)

    return run


def _stream_behavior(behavior: Callable[..., Any]) -> Callable[..., Any]:
    def run(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return behavior(_checked_stream(requests), context)

    return run


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        changes: dict[str, Any] = {"request_deserializer": _tolerant(handler.request_deserializer)}
        if handler.unary_unary is not None:
            changes["unary_unary"] = _unary_behavior(handler.unary_unary)
        elif handler.unary_stream is not None:
            changes["unary_stream"] = _unary_behavior(handler.unary_stream)
        elif handler.stream_unary is not None:
            changes["stream_unary"] = _stream_behavior(handler.stream_unary)
        elif handler.stream_stream is not None:
            changes["stream_stream"] = _stream_behavior(handler.stream_stream)
        try:
            return handler._replace(**changes)
        except AttributeError:  # a handler type that is not grpc's namedtuple: leave it alone
            return handler
