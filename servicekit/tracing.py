"""OpenTelemetry tracing across the three processes: gateway -> ar_service -> dit_service.

Off unless the standard OpenTelemetry environment asks for it (``setup`` reads it once, at start):

- ``OTEL_TRACES_EXPORTER``: ``otlp``, ``console`` or ``none`` (a comma-separated list is allowed);
- without it, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` turns on ``otlp``;
- ``OTEL_SDK_DISABLED=true`` turns everything off.

The OTLP exporter reads its own variables (endpoint, headers, timeout, compression, certificates), the
TracerProvider reads ``OTEL_TRACES_SAMPLER`` and the batch processor ``OTEL_BSP_*``. ``OTEL_SERVICE_NAME``
overrides the service name (``ardit-gateway``, ``ardit-ar``, ``ardit-dit``).

Off costs nothing: no OpenTelemetry module is imported here, ``span`` / ``server_span`` / ``use`` return one
shared ``nullcontext``, ``start_span`` returns None and the helpers accept None; channels get no interceptor
(and FastAPI, finding no tracer provider, traces nothing). On, the SDK is imported by ``setup`` only.

The W3C ``traceparent`` (and ``tracestate``) travel in gRPC metadata: a client interceptor injects the current
context into every call (sync for ar_service -> dit_service, asyncio for the gateway); a servicer opens its
span from the call's metadata (``server_span``) and hands the span's context to its engine, whose worker
thread opens the stage spans under it (``span(name, parent=...)``). The gateway's HTTP spans are FastAPI's
own (FastAPI >= 0.165 traces each request, continuing a caller's ``traceparent``, once a tracer provider is
set): the asyncio interceptor sends the current one on to ar_service.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

_OFF = contextlib.nullcontext()  # stateless and re-entrant: one instance serves every span when off
_tracer: Any = None  # an opentelemetry Tracer once setup() turned tracing on
_provider: Any = None

SERVICE_NAMES = {"gateway": "ardit-gateway", "ar_service": "ardit-ar", "dit_service": "ardit-dit"}


class TracingConfigError(ValueError):
    """The OTEL_* environment asks for something this process cannot do."""


def exporters_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    """The span exporters the environment asks for; empty means tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if names:
        return [] if names == ["none"] else [name for name in names if name != "none"]
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER {name!r} is not supported; use otlp, console or none")
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise TracingConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package opentelemetry-exporter-otlp-proto-grpc; "
                "install it or use http/protobuf (the default)"
            ) from None
        return GrpcExporter()
    raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported; use http/protobuf or grpc")


def setup(service: str) -> bool:
    """Turns tracing on for this process when the OTEL_* environment asks for it; returns whether it is on.

    An environment that asks for what cannot work (an unknown exporter or protocol) stops the process with a
    message saying so (SystemExit), at start rather than at the first span."""
    global _tracer, _provider
    if _tracer is not None:
        return True
    names = exporters_from_env()
    if not names:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: SERVICE_NAMES.get(service, service)}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in names:
        try:
            exporter = _exporter(name)
        except TracingConfigError as exc:
            raise SystemExit(f"{service}: {exc}") from None
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = trace.get_tracer("ardit")
    log.info("%s: tracing on, spans exported via %s", service, ", ".join(names))
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Exports the spans still buffered; for processes that leave without running atexit handlers."""
    if _provider is not None:
        _provider.shutdown()


# -- spans -----------------------------------------------------------------------------------------


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}[kind]


def start_span(name: str, parent: Any = None, kind: str = "internal", **attributes: Any) -> Any:
    """A span that ends elsewhere (``end_span``); under ``parent`` (a context) or the current one. None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=parent, kind=_kind(kind), attributes=_clean(attributes))


def end_span(span: Any, error: str | None = None, **attributes: Any) -> None:
    """Ends ``span`` (None: nothing), marked as failed with ``error`` when given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(_clean(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def set_attributes(span: Any, **attributes: Any) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def context_of(span: Any) -> Any:
    """A context whose current span is ``span``, to hand to another thread (None when off)."""
    if span is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def span(name: str, parent: Any = None, **attributes: Any) -> contextlib.AbstractContextManager:
    """A span around a block, under ``parent`` (a context) or the current one; a shared no-op when off."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(name, context=parent, attributes=_clean(attributes))


def use(context: Any) -> contextlib.AbstractContextManager:
    """Makes ``context`` current for a block (so that the gRPC interceptor sends it); a no-op when None."""
    if context is None:
        return _OFF
    return _attached(context)


@contextlib.contextmanager
def _attached(context: Any) -> Iterator[None]:
    from opentelemetry import context as otel_context

    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry attributes: None dropped, names under ``ardit.`` unless already dotted."""
    return {(key if "." in key else f"ardit.{key}"): value for key, value in attributes.items() if value is not None}


# -- gRPC ------------------------------------------------------------------------------------------


def server_span(name: str, grpc_context: Any, **attributes: Any) -> contextlib.AbstractContextManager:
    """The span of one RPC (kind SERVER) under the caller's ``traceparent``; yields it (None when off).

    Not made current (a streaming handler's generator may resume on other threads): pass
    ``context_of(span)`` to whatever works for the call."""
    if _tracer is None:
        return _OFF
    return _server_span(name, grpc_context, attributes)


@contextlib.contextmanager
def _server_span(name: str, grpc_context: Any, attributes: dict[str, Any]) -> Iterator[Any]:
    from opentelemetry import propagate

    carrier = {key: value for key, value in grpc_context.invocation_metadata() if isinstance(value, str)}
    service, _, method = name.rpartition("/")
    current = start_span(
        name, parent=propagate.extract(carrier), kind="server",
        **{"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}, **attributes,
    )
    try:
        yield current
    except GeneratorExit:
        end_span(current, "the caller went away")
        raise
    except BaseException as exc:
        code = _grpc_code(grpc_context)
        end_span(current, f"{code or type(exc).__name__}: {_grpc_details(grpc_context) or exc}")
        raise
    else:
        code = _grpc_code(grpc_context)
        end_span(current, None if code in (None, "OK") else f"{code}: {_grpc_details(grpc_context)}")


def _grpc_code(grpc_context: Any) -> str | None:
    try:
        code = grpc_context.code()
    except Exception:
        return None
    return getattr(code, "name", None)


def _grpc_details(grpc_context: Any) -> str:
    try:
        return grpc_context.details() or ""
    except Exception:
        return ""


def _inject(metadata: Any) -> list[tuple[str, Any]]:
    """``metadata`` plus the current context's traceparent / tracestate."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    pairs = [(key, value) for key, value in (metadata or ()) if key not in carrier]
    return pairs + list(carrier.items())


class _SyncInjector(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
):
    """Adds the current trace context to every call of a blocking-API channel."""

    @staticmethod
    def _details(details: Any) -> Any:
        return _SyncCallDetails(
            details.method, details.timeout, _inject(details.metadata), details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _SyncCallDetails(
    collections.namedtuple("_SyncCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


def _aio_details(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*_inject(details.metadata))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


# grpc.aio files an interceptor under the first of the four kinds it is an instance of: one class per kind.
class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details), request_iterator)


def intercept_channel(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` (blocking API) sending the current trace context with every call; unchanged when off."""
    if _tracer is None:
        return channel
    return grpc.intercept_channel(channel, _SyncInjector())


def aio_interceptors() -> list[grpc.aio.ClientInterceptor] | None:
    """Interceptors for a grpc.aio channel sending the current trace context; None when off."""
    return None if _tracer is None else [_AioUnaryUnary(), _AioUnaryStream(), _AioStreamUnary(), _AioStreamStream()]
