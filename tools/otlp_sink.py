"""``python -m tools.otlp_sink [--port 4318]``: a tiny OTLP/HTTP trace receiver that prints each trace as a tree.

For trying ardit's tracing without a collector (run it, then start the services with
``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318``), and for the tracing test, which reads the spans it
holds. Accepts ``POST /v1/traces`` with protobuf bodies (the default of OpenTelemetry's OTLP/HTTP exporter,
gzip or not); keeps at most ``max_spans`` spans. Not a collector for production: use the OpenTelemetry
Collector, Jaeger or Tempo there.
"""

from __future__ import annotations

import argparse
import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def parse_export(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service=str(resource.get("service.name", "")), trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), name=s.name, kind=s.kind, start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, status_code=s.status.code,
                    attributes={a.key: _value(a.value) for a in s.attributes},
                ))
    return spans


class OTLPSink:
    """An OTLP/HTTP receiver on a thread; ``spans()`` is what it has received so far."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_spans: int = 100_000, on_spans=None):
        self.max_spans = max_spans
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._on_spans = on_spans
        self.requests = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                try:
                    spans = parse_export(body)
                except Exception:
                    self.send_error(400, "not an OTLP protobuf ExportTraceServiceRequest")
                    return
                sink._add(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-sink", daemon=True)

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.requests += 1
            self._spans.extend(spans[: max(0, self.max_spans - len(self._spans))])
        if self._on_spans is not None:
            self._on_spans(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def start(self) -> OTLPSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OTLPSink:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def format_tree(spans: list[ReceivedSpan]) -> str:
    """Spans as indented trees, children under parents in start order (a span whose parent is not among
    ``spans`` starts a tree of its own, marked with its trace id)."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[ReceivedSpan]] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else None, []).append(s)
    lines: list[str] = []

    def walk(s: ReceivedSpan, depth: int) -> None:
        failed = "  [error]" if s.status_code == 2 else ""
        lines.append(f"{'  ' * depth}{s.name}  ({s.service}, {(s.end_ns - s.start_ns) / 1e6:.1f} ms){failed}")
        for child in children.get(s.span_id, []):
            walk(child, depth + 1)

    for root in children.get(None, []):
        lines.append(f"trace {root.trace_id}" + (f" (under span {root.parent_span_id})" if root.parent_span_id else ""))
        walk(root, 1)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.otlp_sink", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318, help="the OTLP/HTTP default port")
    args = parser.parse_args(argv)
    sink = OTLPSink(args.host, args.port, on_spans=lambda spans: print(format_tree(spans), flush=True))
    print(f"receiving OTLP/HTTP traces on {sink.endpoint}/v1/traces; Ctrl-C stops", flush=True)
    try:
        sink.server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
