"""The gateway's routes: OpenAI's Images and Models APIs over ar_service's gRPC ImageGenerator.

``create_app(settings)`` returns a FastAPI app whose lifespan opens one grpc.aio channel to
ar_service (and one to dit_service, for /health) and closes them on shutdown; run it with
uvicorn (``python -m gateway``) or any ASGI server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import edits, errors, json_body, playground, schemas, stored_images, streaming, translate
from gateway.auth import APIKeyMiddleware, load_api_keys
from gateway.errors import APIError
from gateway.protocol import ImageGenerationRequest, accepted_values
from gateway.settings import GatewaySettings
from protos import ar_pb2, ar_pb2_grpc, channels, common_pb2
from servicekit import tracing
from servicekit.tls import ClientTLS, open_aio_channel

#: The request model a route validates into (generations, or edits, which extend them).
RequestModel = TypeVar("RequestModel", bound=ImageGenerationRequest)

log = logging.getLogger("gateway")

HEALTH_TIMEOUT_S = 2.0
LIST_MODELS_TIMEOUT_S = 10.0


# -- middleware: request id, body limit, one log line, last-resort 500 -----------------------


class GatewayMetrics:
    """The gateway's Prometheus metrics, on a registry of its own (one per app), served at ``GET /metrics``."""

    ROUTES = frozenset({"/", "/v1/images/generations", edits.ROUTE, "/v1/models", "/health", "/metrics"})

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ardit_gateway_requests", "HTTP requests answered, by route and status", ("route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "ardit_gateway_request_seconds", "HTTP request latency, by route", ("route",),
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=self.registry,
        )
        self.in_flight = Gauge("ardit_gateway_requests_in_flight", "HTTP requests being answered", registry=self.registry)

    def route(self, path: str) -> str:
        if path in self.ROUTES:
            return path
        if path.startswith(stored_images.ROUTE_PREFIX):
            return stored_images.ROUTE_PREFIX + "{name}"
        return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"  # bounded label values


class GatewayMiddleware:
    """Pure ASGI middleware (no response buffering) around every HTTP request.

    - refuses bodies over ``max_body_bytes`` (by Content-Length, and by counting what arrives);
    - turns any exception nobody handled into a generic 500 in OpenAI's shape (details logged);
    - adds ``x-request-id`` and logs one line per request: id, user, status, latency, prompt length, the fields
      given without effect.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: GatewayMetrics | None = None,
                 route_limits: dict[str, int] | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.route_limits = route_limits or {}  # paths that take larger bodies (the edits' image uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        state.setdefault("request_id", f"req-{uuid.uuid4().hex}")
        status = 0
        response_started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", state["request_id"].encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        received = 0
        limit = self.route_limits.get(scope.get("path", ""), self.max_body_bytes)

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._too_large(limit)
            return message

        if self.metrics is not None:
            self.metrics.in_flight.inc()
        try:
            if self._declared_length(scope) > limit:
                await self._too_large(limit).response()(scope, receive, send_wrapper)
            else:
                await self.app(scope, limited_receive, send_wrapper)
        except Exception:
            log.exception("request %s: unexpected error", state["request_id"])
            if not response_started:
                response = errors.error_response(500, "internal error in the gateway; see its log", code="internal_error")
                await response(scope, receive, send_wrapper)
            else:
                status = 500
        finally:
            self._log(scope, state, status or 499, started)
            if self.metrics is not None:
                route = self.metrics.route(scope.get("path", ""))
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(route, str(status or 499)).inc()
                self.metrics.latency.labels(route).observe(time.perf_counter() - started)

    def _too_large(self, limit: int) -> APIError:
        return APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    @staticmethod
    def _log(scope: Scope, state: dict[str, Any], status: int, started: float) -> None:
        extra = ""
        if state.get("user") is not None:
            extra += f" user={state['user']!r}"
        if state.get("prompt_chars") is not None:
            extra += f" prompt_chars={state['prompt_chars']} n={state.get('n')}"
        if state.get("ignored"):
            extra += f" ignored={','.join(state['ignored'])}"
        log.info(
            "%s %s %s -> %d in %.1f ms%s",
            state["request_id"], scope.get("method"), scope.get("path"), status, (time.perf_counter() - started) * 1000, extra,
        )


# -- helpers -----------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise APIError(400, "request body is empty; send a JSON object with at least 'prompt'", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its ``$defs`` written in place of each ``$ref``, for embedding in the OpenAPI
    document (where ``#/$defs/...`` would point at the document's root). The request's objects do not nest in
    themselves, so this ends."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: resolve(value) for key, value in node.items() if key != "$defs"}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)


async def _collect(call: Any) -> tuple[list[common_pb2.GeneratedImage], ar_pb2.GenerateImageResponse | None]:
    images: list[common_pb2.GeneratedImage] = []
    completed = None
    async for event in call:
        kind = event.WhichOneof("event")
        if kind == "image":
            images.append(event.image)
        elif kind == "completed":
            completed = event.completed
    return images, completed


async def _check(channel: grpc.aio.Channel) -> str:
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return "UNREACHABLE"
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        return "UNKNOWN"  # e.g. UNIMPLEMENTED: something answers, but not grpc.health.v1
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _render_fault(generator: ar_pb2_grpc.ImageGeneratorStub) -> str:
    """Why the AR's renders fail, when it knows (e.g. its DiT serves another model); "" when it knows of nothing."""
    try:
        status = await generator.GetStatus(common_pb2.GetStatusRequest(), timeout=HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return ""  # the health check already says what it can
    return status.render_fault


async def _health_status(channel: grpc.aio.Channel, probe: grpc.aio.Channel) -> str:
    """SERVING when any replica serves (the health-checked channel reaches only those); otherwise what a replica
    says through a channel that also reaches NOT_SERVING ones (e.g. NOT_SERVING while loading), or UNREACHABLE."""
    status = await _check(channel)
    return status if status == "SERVING" else await _check(probe)


# -- the app -----------------------------------------------------------------------------------


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    api_keys = load_api_keys(settings)
    tls = ClientTLS(
        settings.grpc_tls_ca_file, settings.grpc_tls_cert_file, settings.grpc_tls_key_file, settings.grpc_tls_server_name
    )
    tls.credentials()  # a TLS setting that cannot work fails here, at start, not on the first request

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Requests (and /health) go through health-checked channels: round_robin over the replicas that serve.
        # The probes reach every replica, NOT_SERVING ones too, for /health to say why none serves.
        interceptors = tracing.aio_interceptors()  # None unless tracing is on: calls carry the W3C traceparent
        ar_channel = open_aio_channel(settings.ar_address, tls, channels.channel_options(), interceptors)
        dit_channel = open_aio_channel(settings.dit_address, tls, channels.channel_options(), interceptors)
        probes = [open_aio_channel(target, tls, channels.channel_options(health_checked=False))
                  for target in (settings.ar_address, settings.dit_address)]
        app.state.ar_channel = ar_channel
        app.state.dit_channel = dit_channel
        app.state.probes = probes
        app.state.generator = ar_pb2_grpc.ImageGeneratorStub(ar_channel)
        sweeping = asyncio.ensure_future(stored_images.sweep_forever(app.state.image_store))
        try:
            yield
        finally:
            sweeping.cancel()
            for channel in (ar_channel, dit_channel, *probes):
                await channel.close()

    app = FastAPI(
        title="ardit gateway",
        description="OpenAI-compatible Images API in front of ardit's AR -> DiT services.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    errors.install(app)
    app.add_middleware(APIKeyMiddleware, keys=api_keys)  # inside GatewayMiddleware: 401s are logged too
    metrics = GatewayMetrics()
    app.state.metrics = metrics
    edit_limits = edits.EditLimits(settings.edit_max_image_bytes, settings.edit_max_total_bytes,
                                   settings.edit_max_image_pixels)
    app.add_middleware(
        GatewayMiddleware, max_body_bytes=settings.max_body_bytes, metrics=metrics,
        route_limits={edits.ROUTE: max(settings.max_body_bytes, settings.edit_max_total_bytes + edits.FORM_SLACK_BYTES)},
    )

    app.state.image_store = stored_images.open_store(settings)
    app.include_router(stored_images.router)
    app.include_router(playground.router)

    body_schema = inline_refs(ImageGenerationRequest.model_json_schema())
    edit_schema = inline_refs(edits.ImageEditRequest.model_json_schema())
    edit_schema["properties"] = {
        "image": {"type": "string", "format": "binary", "description": "The input image (PNG, JPEG or WebP)."},
        "image[]": {"type": "array", "items": {"type": "string", "format": "binary"},
                    "description": f"Several input images, in order (at most {edits.MAX_INPUT_IMAGES})."},
        **edit_schema.get("properties", {}),
    }

    @app.post(
        "/v1/images/generations",
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}}},
        responses=schemas.GENERATION_RESPONSES,
    )
    async def generate_images(request: Request) -> Response:
        started, request_id = _start(request)
        parsed = _accept(request, ImageGenerationRequest, parse_json_object(await request.body()))
        message = translate.to_proto(parsed, request_id, settings.model_aliases)
        if parsed.stream:
            return await streaming.open_stream(request, parsed, message)

        call = request.app.state.generator.StreamImage(message, timeout=settings.request_timeout_s)
        return await _answer(request, parsed, call, started)

    @app.post(
        edits.ROUTE,
        openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": edit_schema}}}},
        responses=schemas.GENERATION_RESPONSES,
    )
    async def edit_images(request: Request) -> Response:
        started, request_id = _start(request)
        form = edits.read_form(await request.body(), request.headers.get("content-type", ""), edit_limits)
        parsed = _accept(request, edits.ImageEditRequest, form.fields)
        for index, image in enumerate(form.images):
            edits.check_image(image, index, edit_limits)  # every problem a 400 here, before ar_service
        message = translate.to_proto(parsed, request_id, settings.model_aliases)
        call = request.app.state.generator.EditImage(edits.edit_messages(message, form.images),
                                                     timeout=settings.request_timeout_s)
        if parsed.stream:
            return await streaming.open_stream(request, parsed, message, call, streaming.EDIT_EVENTS)
        return await _answer(request, parsed, call, started)

    def _start(request: Request) -> tuple[float, str]:
        """When an image request arrived and the id it gets (kept for the access log and the error answers)."""
        request.state.request_id = translate.new_request_id()
        return time.perf_counter(), request.state.request_id

    def _accept(request: Request, model: type[RequestModel], fields: dict[str, Any]) -> RequestModel:
        """The request's fields validated by its model (a 400 naming what is wrong), what the access log and the
        metrics record of it, and the fields without effect here; shared by the generations and edits routes."""
        try:
            parsed = model.model_validate(fields)
        except ValidationError as exc:
            raise errors.validation_error(exc.errors(), accepted_values) from None
        request.state.user = parsed.end_user
        request.state.prompt_chars = len(parsed.prompt)
        request.state.n = parsed.n
        request.state.ignored = parsed.ignored_fields()
        parsed.check_supported()
        return parsed

    async def _answer(request: Request, parsed: ImageGenerationRequest, call: Any, started: float) -> Response:
        """The JSON answer of a call that streams ImageEvents (StreamImage, EditImage): every image, then the
        summary; a client that leaves cancels the call."""
        grpc_started = time.perf_counter()
        collecting = asyncio.ensure_future(_collect(call))
        watching = asyncio.ensure_future(streaming.wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():
                call.cancel()  # the client left (or the server is stopping): stop the AR decode and the denoise
                collecting.cancel()
        if collecting not in done:
            raise APIError(499, "the client closed the request", code="client_closed_request")
        images, completed = collecting.result()  # raises the AioRpcError, mapped by errors
        grpc_ms = (time.perf_counter() - grpc_started) * 1000
        if completed is None:
            raise APIError(502, "ar_service ended the stream without a final result", code="bad_gateway")
        urls = await stored_images.publish(request, images, parsed.output_format) if parsed.answer_format == "url" else None
        content = translate.to_openai(parsed, images, completed, gateway_ms=0.0, urls=urls)
        content["timings"]["gateway_ms"] = round((time.perf_counter() - started) * 1000 - grpc_ms, 3)
        return json_body.PicturesJSONResponse(content, headers=translate.ignored_fields_headers(parsed))

    @app.get("/v1/models", responses=schemas.MODELS_RESPONSES)
    async def list_models(request: Request) -> JSONResponse:
        reply = await request.app.state.generator.ListModels(ar_pb2.ListModelsRequest(), timeout=LIST_MODELS_TIMEOUT_S)
        return JSONResponse(translate.models_to_openai(reply, settings.model_aliases))

    @app.get("/v1/models/{model_id:path}", responses=schemas.MODEL_RESPONSES)
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        reply = await request.app.state.generator.ListModels(ar_pb2.ListModelsRequest(), timeout=LIST_MODELS_TIMEOUT_S)
        for entry in translate.models_to_openai(reply, settings.model_aliases)["data"]:
            if entry["id"] == model_id:
                return JSONResponse(entry)
        served = ", ".join(card.id for card in reply.models) or "none"
        aliases = ", ".join(settings.model_aliases) or "none"
        raise APIError(404, f"model {model_id!r} not found; served: {served}; aliases: {aliases}", "model", "model_not_found")

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text: requests by route and status, latency, requests in flight."""
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", responses=schemas.HEALTH_RESPONSES)
    async def health(request: Request) -> JSONResponse:
        ar_probe, dit_probe = request.app.state.probes
        ar, dit = await asyncio.gather(
            _health_status(request.app.state.ar_channel, ar_probe),
            _health_status(request.app.state.dit_channel, dit_probe),
        )
        body: dict[str, str] = {"ar": ar, "dit": dit}
        if ar == "SERVING":
            fault = await _render_fault(request.app.state.generator)
            if fault:
                body["fault"] = fault
        ok = ar == dit == "SERVING" and "fault" not in body
        return JSONResponse({"status": "ok" if ok else "unavailable", **body}, status_code=200 if ok else 503)

    return app
