"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway answers goes through here: its own validation, routing (404/405),
oversized bodies (413), gRPC statuses of the model services (mapped as grpc-gateway does, via
``protos.status``) and anything unexpected (a generic 500; the details go to the log only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.status import effective_code, http_status, param_of, retry_after_of

log = logging.getLogger("gateway")

#: Retry-After (seconds) sent with a 429 when the service did not say.
DEFAULT_RETRY_AFTER_S = "1"


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status == 499:
        return "request_cancelled"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status, headers=headers)


class APIError(Exception):
    """A failure the gateway answers as-is, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


# -- request validation ---------------------------------------------------------------------

_TYPE_WORDS = {
    "string_type": "a string",
    "int_type": "an integer",
    "bool_type": "a boolean",
    "float_type": "a number",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _param_of_loc(loc: tuple[Any, ...]) -> str | None:
    """The top-level body field an error location points at (FastAPI prefixes "body")."""
    parts = [part for part in loc if part != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None


def validation_error(
    errors: Sequence[Mapping[str, Any]], accepted: Callable[[str], str | None] | None = None
) -> APIError:
    """The first pydantic error of a request body as a 400 naming its field; ``accepted(field)`` says what a top-level
    field takes ("one of 'vivid', 'natural'"), for a message that names the accepted values."""
    if not errors:
        return APIError(400, "invalid request body", code="invalid_value")
    first = errors[0]
    kind = first.get("type", "")
    loc = tuple(part for part in first.get("loc", ()) if part != "body")
    param = _param_of_loc(loc)
    if kind == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    if param is None:
        if kind == "missing":
            return APIError(400, "request body is missing; send a JSON object", code="invalid_json")
        return APIError(400, "request body must be a JSON object", code="invalid_json")
    where = ".".join(str(part) for part in loc)  # "svg.model" for a field inside an object
    given = first.get("input")
    code = "invalid_type" if kind in _TYPE_WORDS else "invalid_value"
    if kind == "missing":
        return APIError(400, f"missing required parameter '{where}'", param, "missing_required_parameter")
    if kind == "value_error":
        # Our own validators: their text is the whole message.
        ctx_error = (first.get("ctx") or {}).get("error")
        return APIError(400, str(ctx_error) if ctx_error else first.get("msg", "invalid value"), param, "invalid_value")
    if kind == "extra_forbidden":
        return APIError(400, f"'{where}' is not a field of '{'.'.join(str(part) for part in loc[:-1])}'", param, code)
    described = accepted(param) if accepted is not None and len(loc) == 1 else None
    if described is not None:
        return APIError(400, f"'{param}' must be {described}; got {json.dumps(given, default=str)}", param, code)
    if kind in _TYPE_WORDS:
        return APIError(400, f"'{where}' must be {_TYPE_WORDS[kind]}; got {json.dumps(given, default=str)}", param, code)
    message = first.get("msg", "invalid value")
    return APIError(400, f"invalid value for '{where}': {message}; got {json.dumps(given, default=str)}", param, code)


# -- gRPC statuses --------------------------------------------------------------------------


def from_rpc_error(
    error: grpc.aio.AioRpcError | grpc.RpcError, ar_address: str = "", model_aliases: Mapping[str, str] | None = None
) -> APIError:
    """A model service's gRPC status as the matching HTTP error; an unknown model's 404 also names the aliases."""
    code = effective_code(error)
    status = http_status(code)
    details = error.details() or code.name.lower()
    headers = None
    if code == grpc.StatusCode.UNAVAILABLE:
        if "ar_service" in details or "dit_service" in details:
            message = details  # the service already says which stage is down
        else:
            where = f" at {ar_address}" if ar_address else ""
            message = f"ar_service{where} is unavailable: {details}"
    elif code == grpc.StatusCode.FAILED_PRECONDITION and param_of(error) == "model":
        # The AR and the DiT serve different models (the DiT's refusal names both): no request can succeed until
        # the deployment is fixed, so this is the service's fault (503), not the client's (grpc-gateway's 400).
        status = 503
        message = details
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"the request did not finish in time: {details}"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        message = details
        headers = {"Retry-After": str(retry_after_of(error) or DEFAULT_RETRY_AFTER_S)}
    elif status >= 500:
        message = f"{code.name.lower()}: {details}"
    elif code == grpc.StatusCode.NOT_FOUND and param_of(error) == "model":
        named = ", ".join(f"{alias} (= {model})" for alias, model in (model_aliases or {}).items())
        message = f"{details}; aliases: {named or 'none set (gateway setting model_aliases)'}"
    else:
        message = details
    return APIError(status, message, param_of(error), "model_mismatch" if status == 503 and code ==
                    grpc.StatusCode.FAILED_PRECONDITION else code.name.lower(), headers)


# -- handlers -------------------------------------------------------------------------------


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(list(exc.errors())).response()


async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
    return validation_error(exc.errors()).response()


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = f"no route {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return error_response(status, message, None, code, dict(exc.headers or {}))


async def _rpc_error(request: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
    settings = getattr(request.app.state, "settings", None)
    return from_rpc_error(exc, getattr(settings, "ar_address", ""), getattr(settings, "model_aliases", None)).response()


def install(app: FastAPI) -> None:
    """Registers the handlers; unexpected exceptions are turned into a 500 by the app's middleware."""
    # Starlette types a handler as taking any Exception; it calls each with the class it is registered for.
    handlers: list[tuple[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]]] = [
        (APIError, _api_error),
        (RequestValidationError, _request_validation),
        (ValidationError, _pydantic_validation),
        (StarletteHTTPException, _http_exception),
        (grpc.aio.AioRpcError, _rpc_error),
    ]
    for kind, handler in handlers:
        app.add_exception_handler(kind, handler)
