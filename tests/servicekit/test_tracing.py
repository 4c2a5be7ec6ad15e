"""servicekit.tracing: off unless the OTEL_* environment asks, and then free; on, spans reach an OTLP receiver.

Each case runs in a fresh interpreter: whether the SDK gets imported is a property of the whole process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servicekit.tracing import exporters_from_env
from tools.otlp_sink import OTLPSink

ROOT = Path(__file__).resolve().parents[2]

# Imports what the three services import, sets tracing up as their main()s do, then uses every helper the way the
# services do, and reports what the process holds.
PROBE = """
import json, sys
import grpc
import gateway.app
{imports}
from servicekit import tracing

on = [tracing.setup(name) for name in ("gateway", "ar_service", "dit_service")]
app = gateway.app.create_app()
channel = grpc.insecure_channel("127.0.0.1:1")
with tracing.span("probe.block", None, n=1) as inner:
    span = tracing.start_span("probe.span", None, kind="client", request_id="r1")
    with tracing.use(tracing.context_of(span)):
        pass
    tracing.end_span(span, "failed on purpose", tokens=3)
    tracing.set_attributes(inner, x=1)
tracing.shutdown()
print(json.dumps({
    "on": on,
    "sdk_modules": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
    "shared_no_op": tracing.span("a") is tracing.span("b") is tracing.use(None),
    "start_span": repr(tracing.start_span("c")),
    "channel_unchanged": tracing.intercept_channel(channel) is channel,
    "aio_interceptors": repr(tracing.aio_interceptors()),
}))
"""


def run_probe(env_extra: dict[str, str], imports: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ARDIT_", "FASTAPI_OTEL"))}
    env.update({"PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **env_extra})
    probe = PROBE.replace("{imports}", imports)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_otel_configuration_nothing_is_traced_and_the_sdk_is_never_imported():
    report = run_probe({}, imports="import ar_service.engine, ar_service.server, dit_service.engine, dit_service.server")
    assert report == {
        "on": [False, False, False],
        "sdk_modules": [],
        "shared_no_op": True,
        "start_span": "None",
        "channel_unchanged": True,
        "aio_interceptors": "None",
    }


@pytest.mark.parametrize("switch", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_switched_off_nothing_reaches_a_configured_endpoint(switch):
    with OTLPSink() as sink:
        report = run_probe({"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, **switch})
        assert report["on"] == [False, False, False] and report["sdk_modules"] == []
        assert sink.requests == 0 and sink.spans() == []


def test_an_endpoint_alone_turns_tracing_on_and_spans_reach_it():
    with OTLPSink() as sink:
        report = run_probe({"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "probe"})
        spans = {s.name: s for s in sink.spans()}  # shutdown() flushed them before the process ended
    assert report["on"] == [True, True, True] and report["channel_unchanged"] is False
    assert "_AioUnaryStream" in report["aio_interceptors"]
    assert set(spans) == {"probe.block", "probe.span"}
    block, span = spans["probe.block"], spans["probe.span"]
    assert span.parent_span_id == block.span_id and span.trace_id == block.trace_id and not block.parent_span_id
    assert span.service == "probe"  # OTEL_SERVICE_NAME wins over the built-in names
    assert span.status_code == 2 and span.attributes == {"ardit.request_id": "r1", "ardit.tokens": 3}
    assert block.attributes == {"ardit.n": 1, "ardit.x": 1}


def test_a_configuration_that_cannot_work_stops_the_service_with_a_message(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ARDIT_"))}
    env.update({"PYTHONPATH": str(ROOT), "OTEL_TRACES_EXPORTER": "zipkin"})
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--port", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "gateway: OTEL_TRACES_EXPORTER 'zipkin' is not supported; use otlp, console or none" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
    ],
)
def test_the_exporters_follow_the_standard_variables(env, expected):
    assert exporters_from_env(env) == expected
