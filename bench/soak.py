"""``python -m bench.soak --duration-s 600``: a bounded mixed load with faults against a private local stack.

Not a CI test. Starts dit_service, ar_service and the gateway on loopback (tiny model unless --model-dir),
then for the given duration runs a few client threads sending a mix of valid requests (sizes, n, formats,
steps), bad requests and requests whose client gives up early (disconnects), while a fault thread kills and
restarts dit_service and hangs it with SIGSTOP / SIGCONT. At the end it reports requests served, errors by
kind, lost responses (no HTTP answer while the gateway was up) and duplicated ones (an image set or request
id seen twice, or the wrong number of images), and the RSS growth of each service after warm-up.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.report import emit
from tools.local_stack import LocalStack

SIZES = ["64x64", "128x128", "128x256", "256x128", "256x256"]
FORMATS = ["png", "jpeg", "webp"]
BAD = [
    {"prompt": "x", "size": "250x250"},
    {"prompt": "x", "sampler": "euler"},  # not a knob of the model
    {"prompt": ""},
    {"prompt": "x", "n": 11},
    {"prompt": "x", "num_inference_steps": 0},
    {"prompt": "word " * 3000},
]


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, stack: LocalStack, duration_s: float, warmup_s: float, clients: int, fault_every_s: float, seed: int):
        self.stack = stack
        self.duration_s = duration_s
        self.warmup_s = warmup_s
        self.clients = clients
        self.fault_every_s = fault_every_s
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: collections.Counter = collections.Counter()
        self.served = 0
        self.images = 0
        self.lost: list[str] = []
        self.duplicated: list[str] = []
        self.request_ids: set[str] = set()
        self.image_keys: set[tuple[int, str]] = set()
        self.faults: list[tuple[float, str]] = []
        self.fault_active = threading.Event()
        self.gateway_down = threading.Event()
        self.samples: dict[str, list[tuple[float, int, int]]] = collections.defaultdict(list)  # name -> (t, pid, rss)
        self.started = 0.0
        self.stop = threading.Event()
        self.seed_counter = seed * 1_000_000

    # -- load --------------------------------------------------------------------------------------

    def _next_seed(self) -> int:
        with self.lock:
            self.seed_counter += 100
            return self.seed_counter

    def _record(self, kind: str) -> None:
        with self.lock:
            self.outcomes[kind] += 1

    def client(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                roll = rng.random()
                if roll < 0.70:
                    self._valid(http, rng)
                elif roll < 0.85:
                    self._bad(http, rng)
                else:
                    self._disconnect(rng)

    def _post(self, http: httpx.Client, body: dict, timeout: float = 60) -> httpx.Response | None:
        try:
            return http.post(f"{self.stack.gateway_url}/v1/images/generations", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            if self.gateway_down.is_set():
                self._record("gateway down")
            else:
                with self.lock:
                    self.lost.append(f"{type(exc).__name__}: {exc}"[:200])
                self._record("lost (no answer)")
            return None

    def _valid(self, http: httpx.Client, rng: random.Random) -> None:
        n = rng.choice([1, 1, 1, 2, 3])
        seed = self._next_seed()
        fmt = rng.choice(FORMATS)
        body = {"prompt": f"soak {seed} {'x' * rng.randint(0, 200)}", "size": rng.choice(SIZES), "n": n, "seed": seed,
                "output_format": fmt, "num_inference_steps": rng.randint(2, 10)}
        if rng.random() < 0.3:
            body["negative_prompt"] = "blurry"
        response = self._post(http, body)
        if response is None:
            return
        if response.status_code != 200:
            during = " during a fault" if self.fault_active.is_set() else ""
            self._record(f"{response.status_code} {self._code(response)}{during}")
            return
        payload = response.json()
        with self.lock:
            problem = None
            if payload["request_id"] in self.request_ids:
                problem = f"request id {payload['request_id']} answered twice"
            elif payload["seeds"] != [seed + i for i in range(n)] or len(payload["data"]) != n:
                problem = f"asked for n={n} seed={seed}, got seeds {payload['seeds']} and {len(payload['data'])} images"
            elif any((seed + i, fmt) in self.image_keys for i in range(n)):
                problem = f"seed {seed} served twice"
            if problem:
                self.duplicated.append(problem)
                self.outcomes["duplicated or wrong"] += 1
                return
            self.request_ids.add(payload["request_id"])
            self.image_keys.update((seed + i, fmt) for i in range(n))
            self.served += 1
            self.images += n
            self.outcomes["200 ok"] += 1

    def _bad(self, http: httpx.Client, rng: random.Random) -> None:
        response = self._post(http, dict(rng.choice(BAD)))
        if response is None:
            return
        expected = response.status_code == 400
        self._record("400 as expected" if expected else f"bad request answered {response.status_code} {self._code(response)}")

    def _disconnect(self, rng: random.Random) -> None:
        body = {"prompt": "soak, abandoned", "size": "256x256", "n": 2, "num_inference_steps": 40, "seed": self._next_seed()}
        try:
            httpx.post(f"{self.stack.gateway_url}/v1/images/generations", json=body, timeout=rng.uniform(0.2, 1.5))
            self._record("disconnect came back early")
        except httpx.TimeoutException:
            self._record("client disconnected (intended)")
        except httpx.HTTPError:
            self._record("gateway down" if self.gateway_down.is_set() else "lost (no answer)")

    @staticmethod
    def _code(response: httpx.Response) -> str:
        try:
            return str(response.json()["error"]["code"])
        except Exception:
            return "?"

    # -- faults and memory -------------------------------------------------------------------------

    def faults_thread(self) -> None:
        kinds = ["kill+restart dit_service", "SIGSTOP dit_service 8 s", "kill+restart ar_service", "restart gateway"]
        turn = 0
        while not self.stop.wait(self.fault_every_s):
            if time.monotonic() - self.started > self.duration_s - 30:
                return
            kind = kinds[turn % len(kinds)]
            turn += 1
            t = time.monotonic() - self.started
            self.faults.append((round(t), kind))
            print(f"[{t:6.0f} s] fault: {kind}", flush=True)
            self.fault_active.set()
            try:
                if kind.startswith("kill+restart"):
                    name = kind.split()[-1]
                    self.stack.kill(name)
                    time.sleep(2)
                    self.stack.restart(name)
                elif kind.startswith("SIGSTOP"):
                    self.stack.pause("dit_service")
                    time.sleep(8)
                    self.stack.resume("dit_service")
                else:
                    self.gateway_down.set()
                    self.stack.kill("gateway")
                    self.stack.restart("gateway")
                    self.gateway_down.clear()
                time.sleep(3)  # channels reconnect (<= 1 s backoff); in-flight requests settle
            finally:
                self.fault_active.clear()

    def memory_thread(self) -> None:
        while not self.stop.wait(5):
            t = time.monotonic() - self.started
            for name, process in self.stack.processes.items():
                rss = rss_bytes(process.pid)
                if rss is not None and process.poll() is None:
                    self.samples[name].append((t, process.pid, rss))

    def rss_growth(self) -> dict[str, str]:
        """Per service: RSS at the end vs. after warm-up, over the longest-lived process instance."""
        out = {}
        for name, samples in self.samples.items():
            by_pid: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
            for t, pid, rss in samples:
                by_pid[pid].append((t, rss))
            pid, points = max(by_pid.items(), key=lambda item: item[1][-1][0] - item[1][0][0])
            born = points[0][0]
            after = [(t, rss) for t, rss in points if t >= max(self.warmup_s, born + min(self.warmup_s, 60))]
            if len(after) < 2:
                out[name] = f"not enough samples after warm-up (instance {pid} lived {points[-1][0] - born:.0f} s)"
                continue
            first, last, peak = after[0][1], after[-1][1], max(rss for _, rss in after)
            out[name] = (
                f"{first / 2**20:.1f} MiB -> {last / 2**20:.1f} MiB ({(last - first) / first * 100:+.2f}%), "
                f"peak {peak / 2**20:.1f} MiB, instance pid {pid} over {after[-1][0] - after[0][0]:.0f} s, "
                f"{len(by_pid)} instance(s) in all"
            )
        return out

    def run(self) -> dict:
        self.started = time.monotonic()
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.clients)]
        threads += [threading.Thread(target=self.faults_thread, daemon=True), threading.Thread(target=self.memory_thread, daemon=True)]
        for thread in threads:
            thread.start()
        while time.monotonic() - self.started < self.duration_s:
            time.sleep(min(30, self.duration_s))
            with self.lock:
                print(f"[{time.monotonic() - self.started:6.0f} s] served {self.served}, outcomes {dict(self.outcomes)}", flush=True)
        self.stop.set()
        for thread in threads:
            thread.join(90)
        return {
            "duration_s": round(time.monotonic() - self.started),
            "requests_served": self.served,
            "images_served": self.images,
            "requests_total": sum(self.outcomes.values()),
            "outcomes": dict(self.outcomes.most_common()),
            "lost_responses": len(self.lost),
            "lost_examples": self.lost[:5],
            "duplicated_or_wrong_responses": len(self.duplicated),
            "duplicated_examples": self.duplicated[:5],
            "faults": self.faults,
            "rss_growth_after_warmup": self.rss_growth(),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600, help="how long to run the load (default 600)")
    parser.add_argument("--warmup-s", type=float, default=90, help="RSS growth is measured from here (default 90)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent client threads (default 3)")
    parser.add_argument("--fault-every-s", type=float, default=75, help="seconds between injected faults (default 75)")
    parser.add_argument("--model-dir", type=Path, help="pipeline directory (default: a fresh tiny model)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ardit-soak-") as workdir:
        model_dir = args.model_dir
        if model_dir is None:
            from tools.make_tiny import make_tiny

            model_dir = Path(workdir) / "tiny"
            make_tiny(model_dir)
        stack = LocalStack(model_dir, Path(workdir) / "logs", extra={"gateway": ["--request-timeout-s", "30"]})
        print(f"starting the stack (logs in {stack.logs}) ...", flush=True)
        stack.up()
        try:
            report = Soak(stack, args.duration_s, args.warmup_s, args.clients, args.fault_every_s, args.seed).run()
        finally:
            codes = stack.down()
        report["exit_codes_at_sigterm"] = codes
        emit(report, args.json, heading="\n== bench.soak report ==")
    ok = not report["lost_responses"] and not report["duplicated_or_wrong_responses"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
