"""Faults on a private stack of real processes: kills, hangs, restarts, SIGTERM; and the hardening settings.

The stack here is this module's own (tests kill and stop its services). Its gateway requires an API key
and gives up after 8 s; its ar_service caps pixels per image at 256x256; its dit_service reports
NOT_SERVING for 1 s before it stops accepting calls.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import grpc
import httpx
import pytest

from protos import ar_pb2, ar_pb2_grpc, common_pb2, dit_pb2_grpc
from protos.values import knobs_to_proto
from servicekit.healthcheck import check
from tools.local_stack import LocalStack

KEY = "sk-test-Zq8XbXdH4gkT"
SECRET_PROMPT = "a lighthouse guarded by the secret word PERIWINKLE-93521 at dusk"
SLOW = {"prompt": "a slow one", "size": "256x256", "n": 2, "num_inference_steps": 200, "seed": 3}
FAST = {"prompt": "a quick one", "size": "128x128", "num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def hardened(tiny_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("faults")
    keys = workdir / "keys"
    keys.write_text(f"# test keys\n{KEY}\n")
    stack = LocalStack(
        tiny_model,
        workdir / "logs",
        extra={
            "gateway": ["--request-timeout-s", "8", "--api-keys-file", str(keys)],
            "ar_service": ["--max-pixels", str(256 * 256), "--shutdown-grace-s", "1"],
            "dit_service": ["--shutdown-drain-s", "1", "--shutdown-grace-s", "20"],
        },
        http_headers={"Authorization": f"Bearer {KEY}"},
    )
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


@pytest.fixture
def stack(hardened):
    """The module's stack, every service running and answering before each test."""
    for name in ("dit_service", "ar_service", "gateway"):
        process = hardened.processes[name]
        if name in hardened.stopped:
            hardened.resume(name)
        if process.poll() is not None:
            hardened.start(name)
    hardened.wait_ready(timeout=120)
    _until_ok(hardened)
    return hardened


def _until_ok(stack: LocalStack, timeout: float = 20) -> httpx.Response:
    """The first request after a restart may meet a channel still reconnecting (<= 1 s backoff)."""
    deadline = time.monotonic() + timeout
    while True:
        response = stack.generate(FAST)
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response
        time.sleep(0.3)


def _in_background(function, *args):
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(function, *args)
    pool.shutdown(wait=False)
    return future


def _wait_busy(stack: LocalStack, seconds: float = 1.5) -> None:
    """Until the request is in both stages (dit_service holds its Render, ar_service is decoding), plus a moment:
    a fixed sleep alone is not enough on a loaded machine, where the request may still be queued."""
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(stack.dit_address) as channel:
        stub = dit_pb2_grpc.RendererStub(channel)
        while time.monotonic() < deadline:
            status = stub.GetStatus(common_pb2.GetStatusRequest(), timeout=5)
            if status.queued + status.running > 0:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the request never reached dit_service")
    time.sleep(min(seconds, 0.3))


# -- faults ------------------------------------------------------------------------------------------


def test_dit_killed_mid_request_is_503_naming_the_stage_then_recovers(stack):
    pending = _in_background(stack.generate, SLOW)
    _wait_busy(stack)
    assert not pending.done()
    stack.kill("dit_service")
    killed_at = time.monotonic()
    response = pending.result(timeout=30)
    assert time.monotonic() - killed_at < 5
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert "dit_service" in error["message"] and error["type"] == "server_error"
    # The AR freed the request: it stays SERVING and answers (503 again) while the DiT is down.
    assert check(stack.ar_address) == "SERVING"
    down = stack.generate(FAST, timeout=30)
    assert down.status_code == 503 and "dit_service" in down.json()["error"]["message"]
    # Once the DiT is back, requests succeed; nothing else was restarted.
    ar_pid, gateway_pid = stack.processes["ar_service"].pid, stack.processes["gateway"].pid
    stack.restart("dit_service")
    time.sleep(1.0)  # the AR's channel reconnects within its 1 s backoff
    assert stack.generate(FAST).status_code == 200
    assert (stack.processes["ar_service"].pid, stack.processes["gateway"].pid) == (ar_pid, gateway_pid)


def test_dit_killed_mid_stream_is_unavailable_over_grpc(stack):
    with grpc.insecure_channel(stack.ar_address) as channel:
        stub = ar_pb2_grpc.ImageGeneratorStub(channel)
        request = ar_pb2.GenerateImageRequest(
            prompt="x", width=256, height=256, n=2, seed=1, knobs=knobs_to_proto({"num_inference_steps": 200})
        )
        stream = stub.StreamImage(request, timeout=180)  # far beyond the wait below, even on a loaded machine
        next(stream)  # the request is running
        _wait_busy(stack, 1.0)
        stack.kill("dit_service")
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (info.value.code(), info.value.details())
    assert time.monotonic() - killed_at < 15  # the AR gives up on the lost renderer at once, not at the deadline
    assert "dit_service" in info.value.details()
    stack.restart("dit_service")


def test_ar_killed_mid_request_is_503_then_recovers_without_restarting_the_gateway(stack):
    pending = _in_background(stack.generate, SLOW)
    _wait_busy(stack)
    stack.kill("ar_service")
    killed_at = time.monotonic()
    response = pending.result(timeout=30)
    assert time.monotonic() - killed_at < 5
    assert response.status_code == 503, response.text
    assert "ar_service" in response.json()["error"]["message"]
    health = httpx.get(f"{stack.gateway_url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["ar"] == "UNREACHABLE"
    gateway_pid = stack.processes["gateway"].pid
    stack.restart("ar_service")
    time.sleep(1.0)
    assert stack.generate(FAST).status_code == 200
    assert stack.processes["gateway"].pid == gateway_pid
    # The DiT dropped the dead AR's render: it is free and renders the next request promptly.
    started = time.monotonic()
    assert stack.generate(FAST).status_code == 200
    assert time.monotonic() - started < 10


def test_hung_dit_hits_the_deadline_504_then_recovers(stack):
    stack.pause("dit_service")
    try:
        started = time.monotonic()
        response = stack.generate(FAST, timeout=30)
        elapsed = time.monotonic() - started
    finally:
        stack.resume("dit_service")
    assert response.status_code == 504, response.text
    assert 7 <= elapsed < 14  # the gateway's 8 s request_timeout_s
    assert response.json()["error"]["type"] == "server_error"
    assert _until_ok(stack).status_code == 200


def test_gateway_restarted_while_the_services_run(stack):
    stack.kill("gateway")
    with pytest.raises(httpx.HTTPError):
        stack.generate(FAST, timeout=5)
    stack.restart("gateway")
    assert stack.generate(FAST).status_code == 200


def _generate_over_grpc(stack: LocalStack, steps: int) -> ar_pb2.GenerateImageResponse:
    """Straight to ar_service with a generous deadline (the gateway here gives up after 8 s)."""
    with grpc.insecure_channel(stack.ar_address) as channel:
        request = ar_pb2.GenerateImageRequest(
            prompt="a slow one", width=256, height=256, n=1, seed=3, knobs=knobs_to_proto({"num_inference_steps": steps})
        )
        return ar_pb2_grpc.ImageGeneratorStub(channel).GenerateImage(request, timeout=90)


def test_dit_sigterm_reports_not_serving_finishes_in_flight_work_and_exits_0(stack):
    pending = _in_background(_generate_over_grpc, stack, 15)  # a few seconds of work
    _wait_busy(stack, 0.8)
    stack.processes["dit_service"].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert check(stack.dit_address) == "NOT_SERVING"  # draining: still answering, but not for new work
    assert stack.processes["dit_service"].wait(30) == 0
    response = pending.result(timeout=60)  # the in-flight request finished within the grace period
    assert len(response.images) == 1
    stack.restart("dit_service")


def test_ar_sigterm_cancels_what_outlives_the_grace_period_and_exits_0(stack):
    pending = _in_background(stack.generate, SLOW)
    _wait_busy(stack, 1.0)
    started = time.monotonic()
    assert stack.terminate("ar_service", timeout=15) == 0
    assert time.monotonic() - started < 8  # 1 s grace, then the call is cancelled
    response = pending.result(timeout=30)
    assert response.status_code in (499, 503), response.text
    stack.restart("ar_service")


# -- limits and security on this stack ---------------------------------------------------------------


def test_max_pixels_is_enforced_with_a_clear_error(stack):
    response = stack.generate({**FAST, "size": "512x256"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "size" and "65536" in error["message"]


def test_api_key_is_required_and_health_stays_open(stack):
    url = f"{stack.gateway_url}/v1/images/generations"
    missing = httpx.post(url, json=FAST, timeout=30)
    wrong = httpx.post(url, json=FAST, headers={"Authorization": "Bearer sk-wrong"}, timeout=30)
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{stack.gateway_url}/health", timeout=10).status_code == 200


def test_logs_hold_neither_the_prompt_nor_the_key(stack):
    response = stack.generate({**FAST, "prompt": SECRET_PROMPT})
    assert response.status_code == 200
    httpx.post(f"{stack.gateway_url}/v1/images/generations", json={**FAST, "prompt": SECRET_PROMPT},
               headers={"Authorization": f"Bearer {KEY}x"}, timeout=30)
    too_long = stack.generate({**FAST, "prompt": SECRET_PROMPT + " word" * 3000})
    assert too_long.status_code == 400
    time.sleep(0.5)
    for name in ("gateway", "ar_service", "dit_service"):
        text = stack.log_text(name)
        assert "PERIWINKLE" not in text, name
        assert KEY not in text, name
    assert "prompt_chars=" in stack.log_text("gateway")  # the request was logged, by length
