"""Many users at once, AR side, on real servers: continuous batching with byte-identical images,
admission control (RESOURCE_EXHAUSTED with retry-after), cancellation mid-decode freeing its slot."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import httpx
import pytest

from protos import ar_pb2, ar_pb2_grpc, common_pb2
from protos.values import knobs_to_proto
from tools.local_stack import LocalStack, free_port

FAST = {"num_inference_steps": 4}


def status(address: str) -> common_pb2.EngineStatus:
    with grpc.insecure_channel(address) as channel:
        return ar_pb2_grpc.ImageGeneratorStub(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=10)


def request(prompt: str, size: int, seed: int, **extra) -> ar_pb2.GenerateImageRequest:
    return ar_pb2.GenerateImageRequest(
        prompt=prompt, width=size, height=size, n=1, seed=seed, knobs=knobs_to_proto(FAST), **extra
    )


def wait_for(predicate, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_eight_concurrent_requests_are_batched_and_each_image_equals_its_run_alone(stack):
    sizes = ["128x128", "64x64", "128x64", "64x128", "128x128", "64x64", "128x128", "64x64"]
    bodies = [
        {"prompt": f"a picture of thing {k}", "size": sizes[k], "seed": 1000 + 7 * k, "n": 1 + (k == 5), **FAST}
        for k in range(8)
    ]
    url = f"{stack.gateway_url}/v1/images/generations"

    def post(body):
        response = httpx.post(url, json=body, timeout=180)
        assert response.status_code == 200, response.text
        return [item["b64_json"] for item in response.json()["data"]]

    alone = [post(body) for body in bodies]
    before = status(stack.ar_address)
    start = threading.Barrier(len(bodies))

    def together(body):
        start.wait()
        return post(body)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(together, bodies))
    after = status(stack.ar_address)
    assert batched == alone  # every image byte-identical to the same request run alone
    assert after.largest_batch > 1 and after.batched_steps_total > before.batched_steps_total
    assert after.completed_total - before.completed_total == 8
    assert after.running == 0 and after.queued == 0


def test_cancel_mid_decode_frees_the_slot_and_leaves_the_batch_mate_unchanged(stack):
    mate = request("a quiet harbour at dawn", 256, 77)
    with grpc.insecure_channel(stack.ar_address) as channel:
        stub = ar_pb2_grpc.ImageGeneratorStub(channel)
        alone = stub.GenerateImage(mate, timeout=120).images[0].data
        before = status(stack.ar_address)

        victim = stub.StreamImage(request("a long storm", 512, 3), timeout=120)
        decoded = 0
        for event in victim:
            if event.WhichOneof("event") == "progress" and event.progress.stage == "ar_decode":
                decoded = event.progress.step
                break
        assert decoded >= 1

        mate_progress = threading.Event()
        images = []

        def run_mate():
            for event in stub.StreamImage(mate, timeout=120):
                kind = event.WhichOneof("event")
                if kind == "progress" and event.progress.stage == "ar_decode":
                    mate_progress.set()
                elif kind == "image":
                    images.append(event.image.data)

        thread = threading.Thread(target=run_mate)
        thread.start()
        assert mate_progress.wait(60)  # both decode in one batch now
        victim.cancel()
        with pytest.raises(grpc.RpcError) as stopped:
            for _ in victim:
                pass
        assert stopped.value.code() == grpc.StatusCode.CANCELLED
        thread.join(120)
        assert images == [alone]  # the batch-mate's image is unchanged

    after = wait_for(lambda: (s := status(stack.ar_address)).running == 0 and s.queued == 0 and s)
    assert after.cancelled_total == before.cancelled_total + 1
    assert after.largest_batch > 1


@pytest.fixture(scope="module")
def tight(tiny_model, tmp_path_factory):
    """dit_service + ar_service with one decode slot, room for one waiting request, metrics on, deterministic mode."""
    metrics_port = free_port()
    stack = LocalStack(
        tiny_model,
        tmp_path_factory.mktemp("tight"),
        extra={
            "ar_service": [
                "--max-batch-size", "1", "--max-queued-requests", "1", "--metrics-port", str(metrics_port),
                "--deterministic",  # the CUDA mode's switch must not break the CPU
            ]
        },
    )
    stack.start("dit_service")
    stack.start("ar_service")
    try:
        stack.wait_ready(["dit_service", "ar_service"])
        yield stack, metrics_port
    finally:
        codes = stack.down()
        assert codes["ar_service"] == 0 and codes["dit_service"] == 0, codes


def test_flood_beyond_the_queue_is_refused_at_once_then_served_normally(tight):
    stack, metrics_port = tight
    flood = 6
    barrier = threading.Barrier(flood)

    def call(k):
        with grpc.insecure_channel(stack.ar_address) as channel:
            stub = ar_pb2_grpc.ImageGeneratorStub(channel)
            barrier.wait()
            started = time.monotonic()
            try:
                reply = stub.GenerateImage(request(f"flood {k}", 256, k), timeout=120)
                return "ok", time.monotonic() - started, len(reply.images)
            except grpc.RpcError as exc:
                trailers = dict(exc.trailing_metadata() or ())
                return exc.code(), time.monotonic() - started, trailers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(flood) as pool:
        results = list(pool.map(call, range(flood)))
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [r for r in results if r[0] == "ok"]
    assert len(refused) + len(served) == flood, results  # nothing else: no INTERNAL, no UNAVAILABLE
    assert refused and served, results  # one decodes, at most one waits, the rest are refused
    # Refused at once, not after waiting: every refusal came back before any admitted request finished.
    assert max(seconds for _, seconds, _ in refused) < min(seconds for _, seconds, _ in served)
    for _, _, retry_after in refused:
        assert retry_after is not None and int(retry_after) >= 1
    assert all(count == 1 for _, _, count in served)

    with grpc.insecure_channel(stack.ar_address) as channel:  # serves normally afterwards
        reply = ar_pb2_grpc.ImageGeneratorStub(channel).GenerateImage(request("after the flood", 64, 9), timeout=120)
        assert len(reply.images) == 1
    now = status(stack.ar_address)
    assert now.rejected_total == len(refused) and now.queue_capacity == 1 and now.max_batch_size == 1
    assert now.largest_batch == 1 and now.batched_steps_total == 0
    assert now.completed_total == len(served) + 1 and now.running == 0 and now.queued == 0
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert f"ardit_ar_requests_rejected_total {float(len(refused))}" in metrics
    for name in ("ardit_ar_queue_depth", "ardit_ar_running_streams", "ardit_ar_batch_size_bucket",
                 "ardit_ar_decode_step_seconds_bucket", "ardit_ar_requests_admitted_total",
                 "ardit_ar_requests_cancelled_total", "ardit_ar_requests_completed_total"):
        assert name in metrics, name
