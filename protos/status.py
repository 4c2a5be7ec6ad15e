"""Errors across the wire: gRPC status codes, the parameter they blame, and HTTP equivalents.

A service that rejects a request names the offending parameter in the trailing metadata
key ``ardit-error-param`` so that the gateway can fill OpenAI's ``error.param``.
The HTTP mapping follows grpc-gateway's HTTPStatusFromCode.
"""

from __future__ import annotations

from typing import NoReturn
from urllib.parse import quote, unquote

import grpc

PARAM_METADATA_KEY = "ardit-error-param"
#: Trailing metadata of a RESOURCE_EXHAUSTED answer: seconds after which a retry may succeed (HTTP Retry-After).
RETRY_AFTER_METADATA_KEY = "retry-after"

HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


class RequestRejected(Exception):
    """Raised by engine code for a request it cannot serve; transports turn it into a status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # a busy service's hint, passed on to whoever called


def abort(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    param: str | None = None,
    retry_after_s: int | None = None,
) -> NoReturn:
    """Ends an RPC with ``code``, naming the parameter at fault and when to retry, when there are such."""
    trailers = []
    if param:
        # Metadata values must be printable ASCII; a parameter is whatever name the caller sent
        # (an unknown knob may be any string), so it travels percent-encoded.
        trailers.append((PARAM_METADATA_KEY, quote(param, safe="")))
    if retry_after_s is not None:
        trailers.append((RETRY_AFTER_METADATA_KEY, str(int(retry_after_s))))
    if trailers:
        context.set_trailing_metadata(tuple(trailers))
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


def abort_rejected(context: grpc.ServicerContext, error: RequestRejected) -> NoReturn:
    abort(context, error.code, error.message, error.param, error.retry_after_s)


def retry_after_of(error: grpc.RpcError) -> int | None:
    """The retry hint a downstream service sent with its refusal, if any (whole seconds, >= 1)."""
    trailers = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailers:
        if key == RETRY_AFTER_METADATA_KEY:
            try:
                return max(1, int(value if isinstance(value, str) else value.decode("ascii", "replace")))
            except ValueError:
                return None
    return None


def param_of(error: grpc.RpcError) -> str | None:
    """The parameter a downstream service blamed, if it named one."""
    trailers = getattr(error, "trailing_metadata", lambda: None)() or ()
    for key, value in trailers:
        if key == PARAM_METADATA_KEY:
            return unquote(value if isinstance(value, str) else value.decode("ascii", "replace"))
    return None


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


_CONNECTION_LOSS_MARKERS = ("rst_stream", "socket closed", "connection reset", "goaway", "broken pipe", "failed to connect")


def effective_code(error: grpc.RpcError) -> grpc.StatusCode:
    """The status a caller should see: a peer lost mid-call can surface as INTERNAL or UNKNOWN
    (RST_STREAM, socket closed); to the caller that is the same fault as UNAVAILABLE."""
    code = error.code()
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        details = (error.details() or "").lower()
        if any(marker in details for marker in _CONNECTION_LOSS_MARKERS):
            return grpc.StatusCode.UNAVAILABLE
    return code

