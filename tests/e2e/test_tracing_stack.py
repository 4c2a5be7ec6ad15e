"""OpenTelemetry on the three real processes: one request is one connected trace, gateway -> ar_service -> dit_service.

The services export with the real OTLP/HTTP exporter, configured only by the standard OTEL_* variables, to a
receiver on loopback (tools/otlp_sink.py) that this test reads.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx

from tools.local_stack import LocalStack
from tools.otlp_sink import OTLPSink, format_tree

SERVER, CLIENT = 2, 3  # OTLP SpanKind values


def _wait_for(sink: OTLPSink, wanted: Counter[str], timeout: float = 60) -> list:
    """The received spans once at least `wanted[name]` spans of each name are in: each process exports on its own
    schedule, so one image's spans can arrive well before the other's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = sink.spans()
        if not wanted - Counter(s.name for s in spans):
            return spans
        time.sleep(0.1)
    return sink.spans()


def test_one_request_is_one_connected_trace_across_the_three_processes(tiny_model, tmp_path):
    with OTLPSink() as sink:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s instead of 5 s
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        stack = LocalStack(tiny_model, tmp_path / "logs", env=env).up()
        try:
            caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
            response = httpx.post(
                f"{stack.gateway_url}/v1/images/generations",
                json={"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 3, "seed": 5, "n": 2},
                headers={"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"},  # the caller's own trace goes on
                timeout=120,
            )
            assert response.status_code == 200, response.text
            request_id = response.json()["request_id"]
            # one request of two images: three prefills (two prompts and the negative one), then per image a
            # decode, a render and the DiT's call with its three stages
            wanted = Counter({"POST /v1/images/generations": 1, "ardit.v1.ImageGenerator/StreamImage": 1,
                              "ar.prefill": 3, "ar.decode": 2, "ar.render": 2, "ardit.v1.Renderer/Render": 2,
                              "dit.denoise": 2, "dit.vae_decode": 2, "dit.encode": 2})
            spans = _wait_for(sink, wanted)
        finally:
            stack.down()

    tree = format_tree(spans)
    request = [s for s in spans if s.trace_id == caller_trace]
    assert not wanted - Counter(s.name for s in request), tree
    # the request's spans are all in the caller's trace; the /health probes of the start-up are traces of their own
    others = [s for s in spans if s.trace_id != caller_trace]
    assert not {s.service for s in others} - {"ardit-gateway"}, tree
    assert {s.name for s in others if not s.parent_span_id} == {"GET /health"}, tree

    by_id = {s.span_id: s for s in request}
    assert len(by_id) == len(request)

    def one(name: str):
        found = [s for s in request if s.name == name]
        assert len(found) == 1, (name, tree)
        return found[0]

    def parent(span):
        assert span.parent_span_id in by_id, (span.name, tree)  # every span hangs in this one trace
        return by_id[span.parent_span_id]

    http = one("POST /v1/images/generations")
    assert http.service == "ardit-gateway" and http.kind == SERVER
    assert http.parent_span_id == "00f067aa0ba902b7"  # the caller's span
    assert http.attributes["http.response.status_code"] == 200 and http.attributes["http.route"] == "/v1/images/generations"

    stream = one("ardit.v1.ImageGenerator/StreamImage")
    assert stream.service == "ardit-ar" and stream.kind == SERVER
    assert parent(stream) is one("fastapi.endpoint") and parent(one("fastapi.endpoint")) is http  # FastAPI's own spans
    assert stream.attributes["ardit.request_id"] == request_id and stream.attributes["ardit.n"] == 2

    ar_children = [s for s in request if s.parent_span_id == stream.span_id]
    # Per image a prefill, a decode and a render; once per request the negative prompt's prefill (the model's default
    # negative prompt, as guidance is on).
    assert sorted(s.name for s in ar_children) == ["ar.decode"] * 2 + ["ar.prefill"] * 3 + ["ar.render"] * 2, tree
    prefills = [s for s in ar_children if s.name == "ar.prefill"]
    assert sorted(str(s.attributes.get("ardit.image_index", s.attributes.get("ardit.prompt"))) for s in prefills) == [
        "0", "1", "negative"], tree
    assert all(s.service == "ardit-ar" for s in ar_children)
    renders = {s.attributes["ardit.image_index"]: s for s in ar_children if s.name == "ar.render"}
    assert set(renders) == {0, 1} and all(s.kind == CLIENT for s in renders.values())
    assert {s.attributes["ardit.tokens"] for s in ar_children if s.name == "ar.decode"} == {4 * 5 + 1}  # 4x4 grid + EOLs + 1

    dit_calls = [s for s in request if s.name == "ardit.v1.Renderer/Render"]
    assert len(dit_calls) == 2
    for call in dit_calls:  # each render of the AR is the parent of one Render call in dit_service
        assert call.service == "ardit-dit" and call.kind == SERVER
        index = call.attributes["ardit.seed"] - 5
        assert parent(call) is renders[index]
        stages = sorted((s.name, s.attributes["ardit.image_index"]) for s in request if s.parent_span_id == call.span_id)
        assert stages == [("dit.denoise", index), ("dit.encode", index), ("dit.vae_decode", index)], tree
        denoise = next(s for s in request if s.parent_span_id == call.span_id and s.name == "dit.denoise")
        assert denoise.attributes["ardit.steps"] == 3
    assert all(s.status_code != 2 for s in request), tree  # nothing failed
