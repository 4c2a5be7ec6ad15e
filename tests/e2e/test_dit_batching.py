"""dit_service under concurrency, on real processes: step-level batching that leaves every image as it is alone,
a bounded queue that refuses at once (RESOURCE_EXHAUSTED at gRPC level, 429 with Retry-After through the
gateway), and a cancelled render that frees its slot without touching its batch-mates."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import grpc
import httpx
import pytest
import torch

from protos import common_pb2, dit_pb2, dit_pb2_grpc
from protos.codec import encode_tensor
from protos.values import knobs_to_proto
from tools.local_stack import LocalStack, free_port

HIDDEN = 64  # the tiny AR's hidden size
TEXT, IMAGE, NEGATIVE = dit_pb2.CONDITION_KIND_TEXT, dit_pb2.CONDITION_KIND_IMAGE, dit_pb2.CONDITION_KIND_NEGATIVE
END = dit_pb2.RenderInput(end=dit_pb2.RenderEnd())


def messages(seed: int, steps: int, guidance: float, cond_seed: int = 0, negative: int = 0, cfg_range=(0.0, 1.0),
             size: int = 128) -> list[dit_pb2.RenderInput]:
    g = torch.Generator().manual_seed(cond_seed)
    text, image = torch.randn(3 + cond_seed % 3, HIDDEN, generator=g), torch.randn(72, HIDDEN, generator=g)
    knobs = knobs_to_proto({"num_inference_steps": steps, "text_guidance_scale": guidance, "cfg_range": list(cfg_range)})
    header = dit_pb2.RenderHeader(
        request_id=f"batch-{seed}", width=size, height=size, n=1, seed=seed, hidden_size=HIDDEN, dtype="float32",
        text_positions=text.shape[0], image_positions=72, negative_positions=negative, knobs=knobs,
    )
    out = [dit_pb2.RenderInput(header=header)]
    for kind, tensor in ((TEXT, text), (IMAGE, image), (NEGATIVE, torch.randn(negative, HIDDEN, generator=g))):
        if tensor.shape[0]:
            out.append(dit_pb2.RenderInput(chunk=dit_pb2.ConditionChunk(kind=kind, hidden_states=encode_tensor(tensor))))
    return out + [END]


def image_of(events) -> bytes:
    (data,) = [e.image.data for e in events if e.WhichOneof("event") == "image"]
    return data


def status(stub) -> common_pb2.EngineStatus:
    return stub.GetStatus(common_pb2.GetStatusRequest(), timeout=10)


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def start_dit(tiny_model, workdir, *flags) -> LocalStack:
    stack = LocalStack(tiny_model, workdir / "logs", extra={"dit_service": list(flags)})
    stack.start("dit_service")
    stack.wait_ready(["dit_service"], timeout=120)
    return stack


@pytest.fixture(scope="module")
def batching(tiny_model, tmp_path_factory):
    metrics_port = free_port()
    stack = start_dit(tiny_model, tmp_path_factory.mktemp("dit_batching"), "--max-batch-size", "4",
                      "--max-queued-renders", "8", "--metrics-port", str(metrics_port))
    stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        with grpc.insecure_channel(stack.dit_address) as channel:
            yield SimpleNamespace(stub=dit_pb2_grpc.RendererStub(channel), stack=stack)
    finally:
        stack.down()


# Different seeds, conditions, guidance, cfg ranges, negative conditions and step counts.
SPECS = [
    dict(seed=11, steps=14, guidance=4.0, cond_seed=1),
    dict(seed=12, steps=10, guidance=1.0, cond_seed=2),
    dict(seed=13, steps=16, guidance=7.5, cond_seed=3, negative=5, cfg_range=(0.2, 0.8)),
    dict(seed=14, steps=8, guidance=2.0, cond_seed=4, negative=2),
]


def test_concurrent_renders_are_batched_and_each_image_equals_its_solo_render(batching):
    metrics_url, batching = batching.stack.metrics_url, batching.stub
    before = status(batching)
    results: dict[int, bytes] = {}

    def run(k: int) -> None:
        time.sleep(0.01 * k)  # arrive a little apart: later renders join a batch already stepping
        results[k] = image_of(list(batching.Render(iter(messages(**SPECS[k])), timeout=60)))

    with concurrent.futures.ThreadPoolExecutor(len(SPECS)) as pool:
        for future in [pool.submit(run, k) for k in range(len(SPECS))]:
            future.result()
    after = status(batching)
    assert after.largest_batch > 1, after
    assert after.batched_steps_total > before.batched_steps_total
    assert after.completed_total - before.completed_total == len(SPECS)
    assert (after.queued, after.running, after.max_batch_size, after.queue_capacity) == (0, 0, 4, 8)

    for k, spec in enumerate(SPECS):  # each alone, one after the other
        alone = image_of(list(batching.Render(iter(messages(**spec)), timeout=60)))
        assert alone == results[k], f"render {k} changed when batched"
    text = httpx.get(metrics_url, timeout=10).text
    assert "ardit_dit_renders_completed_total" in text and 'ardit_dit_batch_size_bucket{le="4.0"}' in text


def test_cancelled_render_leaves_the_batch_and_its_mates_are_unchanged(batching):
    batching = batching.stub
    mates = [SPECS[0], SPECS[2]]
    solo = [image_of(list(batching.Render(iter(messages(**spec)), timeout=60))) for spec in mates]
    before = status(batching)
    doomed = batching.Render(iter(messages(seed=99, steps=200, guidance=4.0, cond_seed=9)), timeout=60)
    stepping = threading.Event()

    def watch() -> None:
        try:
            for event in doomed:
                if event.WhichOneof("event") == "progress" and event.progress.stage == "denoise":
                    stepping.set()
        except grpc.RpcError:
            pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert stepping.wait(30)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda s: image_of(list(batching.Render(iter(messages(**s)), timeout=60))), s)
                   for s in mates]
        wait_for(lambda: status(batching).running == 3)  # all three in one batch
        doomed.cancel()  # mid-denoise
        wait_for(lambda: status(batching).cancelled_total == before.cancelled_total + 1)
        batched = [f.result() for f in futures]
    watcher.join(10)
    wait_for(lambda: status(batching).running == 0)
    after = status(batching)
    assert after.queued == 0 and after.completed_total == before.completed_total + 2
    assert batched == solo


# -- the batch window -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def windowed(tiny_model, tmp_path_factory):
    """A dit_service whose new batch waits (up to a minute) for renders still on their way."""
    metrics_port = free_port()
    stack = start_dit(tiny_model, tmp_path_factory.mktemp("dit_window"), "--max-batch-size", "4",
                      "--batch-window-s", "60", "--metrics-port", str(metrics_port))
    try:
        with grpc.insecure_channel(stack.dit_address) as channel:
            yield SimpleNamespace(stub=dit_pb2_grpc.RendererStub(channel), metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stack.down()


def metric(url: str, name: str) -> float:
    (line,) = [line for line in httpx.get(url, timeout=10).text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def test_renders_whose_conditions_complete_apart_are_denoised_in_shared_steps(windowed):
    stub = windowed.stub
    specs = [dict(seed=31, steps=6, guidance=4.0, cond_seed=1), dict(seed=32, steps=6, guidance=4.0, cond_seed=2),
             dict(seed=33, steps=6, guidance=1.0, cond_seed=3)]
    solo = [image_of(list(stub.Render(iter(messages(**spec)), timeout=60))) for spec in specs]
    before = status(stub)
    gates = [threading.Event() for _ in specs]

    def held(spec, gate):  # header and condition now, the end marker when the gate opens
        *opening, end = messages(**spec)
        yield from opening
        gate.wait()
        yield end

    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(lambda s, g: image_of(list(stub.Render(held(s, g), timeout=120))), spec, gate)
                   for spec, gate in zip(specs, gates, strict=True)]
        wait_for(lambda: status(stub).queued == len(specs))  # all three admitted, none complete
        for gate in gates:  # the conditions complete apart, as AR streams finish at different times
            gate.set()
            time.sleep(0.2)
        batched = [f.result() for f in futures]
    after = status(stub)
    assert after.largest_batch == 3
    assert after.batched_steps_total - before.batched_steps_total == 6  # every step shared by all three
    assert metric(windowed.metrics_url, "ardit_dit_batch_window_seconds_count") >= 1
    assert batched == solo


# -- admission control --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    """A private stack whose dit_service runs one image at a time and queues at most one render."""
    stack = LocalStack(tiny_model, tmp_path_factory.mktemp("dit_small") / "logs",
                       extra={"dit_service": ["--max-queued-renders", "1", "--max-batch-size", "1"]})
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


def test_full_queue_is_refused_at_once_with_retry_after(small):
    with grpc.insecure_channel(small.dit_address) as channel:
        stub = dit_pb2_grpc.RendererStub(channel)
        running = stub.Render(iter(messages(seed=1, steps=200, guidance=4.0)), timeout=60)
        assert next(running).progress.stage == "condition_received"
        wait_for(lambda: status(stub).running == 1)
        waiting = stub.Render(iter(messages(seed=2, steps=200, guidance=4.0)), timeout=60)
        assert next(waiting).progress.stage == "condition_received"
        assert status(stub).queued == 1
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Render(iter(messages(seed=3, steps=2, guidance=4.0)), timeout=60))
        assert status(stub).running == 1 and status(stub).queued == 1  # refused at once, not after waiting
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry_after = dict(info.value.trailing_metadata())["retry-after"]
        assert int(retry_after) >= 1
        assert status(stub).rejected_total >= 1
        running.cancel()
        waiting.cancel()
        wait_for(lambda: status(stub).running == 0 and status(stub).queued == 0)
        # served normally afterwards
        assert image_of(list(stub.Render(iter(messages(seed=4, steps=2, guidance=4.0)), timeout=60)))


def test_flood_through_the_gateway_is_429_with_retry_after_never_5xx(small):
    body = {"prompt": "a flood", "size": "128x128", "num_inference_steps": 12}

    def post(i: int) -> httpx.Response:
        return httpx.post(f"{small.gateway_url}/v1/images/generations", json={**body, "seed": i}, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, [(r.status_code, r.text[:200]) for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    assert refused, codes
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted"
    # and the stack serves normally afterwards
    ok = httpx.post(f"{small.gateway_url}/v1/images/generations",
                    json={"prompt": "after the flood", "size": "128x128", "num_inference_steps": 2, "seed": 1}, timeout=120)
    assert ok.status_code == 200, ok.text
    metrics = httpx.get(f"{small.gateway_url}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert 'ardit_gateway_requests_total{' in metrics.text and 'status="429"' in metrics.text
