"""Two ar_service and two dit_service replicas behind one gateway, as real processes on loopback.

The gateway reaches the ARs, and each AR the DiTs, through one gRPC target listing both replicas
(``ipv4:127.0.0.1:P1,127.0.0.1:P2``): gRPC's round_robin picks a replica per request and per Render
stream, its health checking skips replicas that do not serve, its retry policy moves a refused or
never-started call to the other replica. Every answer is checked against the image the ordinary
one-replica stack (the session's ``stack``) makes for the same seed.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from PIL import Image

from tools.local_stack import LocalStack

WORK = {"prompt": "a lighthouse on a cliff", "size": "128x128", "num_inference_steps": 20}
SEEDS = list(range(100, 108))
SLOW = {"prompt": "a slow one", "size": "256x256", "num_inference_steps": 200, "seed": 9}  # ~10x a WORK request
CLIENTS = 4  # the steady load: this many requests at a time


@pytest.fixture(scope="module")
def replicated(tiny_model, tmp_path_factory):
    stack = LocalStack(
        tiny_model,
        tmp_path_factory.mktemp("replicas") / "logs",
        ar_replicas=2,
        dit_replicas=2,
        extra={
            "ar_service": ["--shutdown-grace-s", "120"],
            "dit_service": ["--shutdown-grace-s", "120"],
        },
    )
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="module")
def reference(stack) -> dict[int, bytes]:
    """Each seed's image from the one-replica stack."""
    images = {}
    for seed in SEEDS:
        response = httpx.post(f"{stack.gateway_url}/v1/images/generations", json={**WORK, "seed": seed}, timeout=120)
        assert response.status_code == 200, response.text
        images[seed] = base64.b64decode(response.json()["data"][0]["b64_json"])
    return images


def _image(response: httpx.Response) -> bytes:
    (item,) = response.json()["data"]
    return base64.b64decode(item["b64_json"])


def _admitted(stack: LocalStack) -> dict[str, int]:
    return {name: stack.engine_status(name).admitted_total for name in stack.names if name != "gateway"}


def _wait_for(condition, what: str, timeout: float = 60, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_requests_spread_over_both_replicas_of_each_stage_with_one_replicas_images(replicated, reference):
    before = _admitted(replicated)
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        responses = list(pool.map(lambda seed: replicated.generate({**WORK, "seed": seed}), SEEDS))
    for seed, response in zip(SEEDS, responses, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["seed"] == seed
        assert _image(response) == reference[seed], f"seed {seed}: not the one-replica stack's image"
    after = _admitted(replicated)
    for kind in ("ar_service", "dit_service"):
        share = {name: after[name] - before[name] for name in replicated.replicas(kind)}
        assert sum(share.values()) == len(SEEDS), share  # one request each, no duplicates
        assert all(count > 0 for count in share.values()), share


@dataclass
class Outcome:
    seed: int
    started: float
    ended: float
    response: httpx.Response


class SteadyLoad:
    """CLIENTS threads sending WORK requests back to back, seeds cycling through SEEDS, until stopped."""

    def __init__(self, stack: LocalStack):
        self.stack = stack
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.count = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(CLIENTS)
        self.clients = [self.pool.submit(self._client) for _ in range(CLIENTS)]

    def _client(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                seed = SEEDS[self.count % len(SEEDS)]
                self.count += 1
            started = time.monotonic()
            response = self.stack.generate({**WORK, "seed": seed}, timeout=120)
            with self.lock:
                self.outcomes.append(Outcome(seed, started, time.monotonic(), response))

    def finished_since(self, moment: float) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if o.started > moment)

    def close(self) -> list[Outcome]:
        self.stop.set()
        for client in self.clients:
            client.result(timeout=180)
        self.pool.shutdown()
        return self.outcomes


def test_a_dit_replica_killed_under_load_fails_only_its_own_requests_then_rejoins(replicated, reference):
    victim = "dit_service-1"
    load = SteadyLoad(replicated)
    try:
        _wait_for(lambda: load.finished_since(0) >= CLIENTS, "the load getting going", timeout=120)

        def rendering():  # a render the AR already got an answer from (running), not one still being streamed
            status = replicated.engine_status(victim)
            return status if status.running > 0 else None

        _wait_for(rendering, f"{victim} rendering")
        time.sleep(0.1)
        in_flight = _wait_for(rendering, f"{victim} rendering")
        replicated.kill(victim)
        killed_at = time.monotonic()
        _wait_for(lambda: load.finished_since(killed_at) >= 2 * CLIENTS, "requests after the kill", timeout=120)
    finally:
        outcomes = load.close()

    try:
        failed = [o for o in outcomes if o.response.status_code != 200]
        for outcome in failed:  # only work in flight on the victim: 503 naming the stage, soon after the kill
            assert outcome.response.status_code == 503, outcome.response.text
            assert "dit_service" in outcome.response.json()["error"]["message"]
            assert outcome.started < killed_at and outcome.ended - killed_at < 30
        assert 1 <= len(failed) <= in_flight.running + in_flight.queued, (len(failed), in_flight)
        for outcome in outcomes:  # every other request: its own image, once
            if outcome.response.status_code == 200:
                assert outcome.response.json()["seed"] == outcome.seed
                assert _image(outcome.response) == reference[outcome.seed], f"seed {outcome.seed}: another image"
        assert sum(1 for o in outcomes if o.started > killed_at) >= 2 * CLIENTS
    finally:  # the module's later tests need both replicas, whatever happened here
        replicated.restart(victim)

    def victim_got_work() -> bool:
        response = replicated.generate({**WORK, "seed": SEEDS[0]})
        assert response.status_code == 200, response.text
        assert _image(response) == reference[SEEDS[0]]
        return replicated.engine_status(victim).admitted_total > 0  # a new process: counters start at 0

    _wait_for(victim_got_work, f"{victim} receiving work after its restart", timeout=30, every=0.2)


def test_draining_replicas_finish_in_flight_work_while_new_requests_go_elsewhere(replicated, reference):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    slow = pool.submit(replicated.generate, SLOW, 180)
    pool.shutdown(wait=False)

    def holder(kind: str) -> str | None:
        for name in replicated.replicas(kind):
            status = replicated.engine_status(name)
            if status.running + status.queued > 0:
                return name
        return None

    ar = _wait_for(lambda: holder("ar_service"), "the slow request decoding", every=0.02)
    dit = _wait_for(lambda: holder("dit_service"), "the slow request reaching a renderer", every=0.02)
    before = _admitted(replicated)
    for name in (ar, dit):
        replicated.processes[name].send_signal(signal.SIGTERM)

    for seed in SEEDS[:2]:  # new work while both drain: served, by the other replicas only
        response = replicated.generate({**WORK, "seed": seed})
        assert response.status_code == 200, response.text
        assert _image(response) == reference[seed]
    assert not slow.done(), "the slow request ended before the drain was seen; make it slower"
    after = {name: replicated.engine_status(name).admitted_total for name in before if name not in (ar, dit)}
    assert {name: after[name] - before[name] for name in after} == {name: 2 for name in after}

    response = slow.result(timeout=180)  # the in-flight request finished on the draining replicas
    assert response.status_code == 200, response.text
    assert response.json()["seed"] == SLOW["seed"]
    assert Image.open(io.BytesIO(_image(response))).size == (256, 256)
    for name in (ar, dit):
        assert replicated.processes[name].wait(60) == 0, replicated.log_text(name)[-2000:]
