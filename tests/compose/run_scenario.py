"""compose.yaml for real, through the Docker engine, with the openai client on port 8000 (`make compose-test`).

tests/compose/run.sh makes the base image and the wheelhouse first, then runs this. Phases, each timed:

1. build: ``docker compose build`` of the image from the debootstrapped base and wheelhouse/ (no network; compose
   carries its own BuildKit client), then its size
2. up: ``docker compose up --wait``: model-init, then dit, ar and the gateway, each gated on the previous one's health
3. b64_json, url (the URL fetched) and streamed (partial images, then the image) requests with the openai client,
   then an edit of the first answer's picture (``images.edit``, multipart), which the default Dev shapes model makes
4. a DiT crash: its process is SIGKILLed (what the kernel's OOM killer does) and compose's ``restart: unless-stopped``
   starts it again, while the gateway answers 503 and then 200. Not ``docker kill``: Docker takes that for a manual
   stop and keeps such a container stopped (docker-kill(1): "the restart policy is disabled until the next time the
   container is started"), so no restart policy ever sees it.
5. ``--scale ar=2 --scale dit=2``: requests until each of the four model replicas has served one, read from each
   replica's Prometheus metrics (``docker compose exec --index N``; the ports are not published)
6. ``docker compose down -v``, and no container, network or volume of the project is left

The project is named ``ardit-compose-test``, so it never touches the volumes of a project started by hand, and it
is taken down whatever happens (its logs go to artifacts/compose-test/ on a failure). ``--down-only`` just takes a
leftover one down.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import compose
import httpx
import openai
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_BINARY = Path(compose.__file__).parent / "docker-compose"
PROJECT = "ardit-compose-test"
FILES = (ROOT / "compose.yaml", ROOT / "tests" / "compose" / "compose.test.yaml")
IMAGE = "ardit:latest"
GATEWAY = "http://127.0.0.1:8000"
ARTIFACTS = ROOT / "artifacts" / "compose-test"
PROMPT = "a small red star at the top, blue background"
EDIT = "paint the background yellow"
SIZE = "128x128"
#: (service, metrics port, the counter of finished work) of each model service; compose.yaml turns the ports on.
REPLICA_COUNTERS = (("ar", 9451, "ardit_ar_requests_completed_total"), ("dit", 9452, "ardit_dit_renders_completed_total"))
SCALE_TIMEOUT_S = 240.0
RECOVERY_TIMEOUT_S = 240.0


class ScenarioFailed(AssertionError):
    pass


def check(condition: object, message: str) -> None:
    if not condition:
        raise ScenarioFailed(message)


def default_model() -> str:
    """The model compose serves by default: its id is the name of compose.yaml's default ARDIT_MODEL directory."""
    found = set(re.findall(r"\$\{ARDIT_MODEL:-[^}]*/([^/}]+)\}", FILES[0].read_text()))
    check(len(found) == 1, f"compose.yaml names one default ARDIT_MODEL, not {sorted(found)}")
    return found.pop()


MODEL = default_model()


def environment() -> dict[str, str]:
    """This process's environment without ARDIT_* (which compose.yaml interpolates): the project as committed."""
    return {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}


def run(command: list[str], timeout: float = 600, check_rc: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment(), cwd=ROOT)
    if check_rc and result.returncode != 0:
        raise ScenarioFailed(f"`{' '.join(command)}` exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


def compose_cmd(*args: str, timeout: float = 600, check_rc: bool = True) -> subprocess.CompletedProcess[str]:
    files = [flag for path in FILES for flag in ("-f", str(path))]
    return run([str(COMPOSE_BINARY), "-p", PROJECT, *files, *args], timeout=timeout, check_rc=check_rc)


def docker(*args: str, timeout: float = 120, check_rc: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["docker", *args], timeout=timeout, check_rc=check_rc)


class Timings:
    def __init__(self, earlier: list[str]):
        self.lines = list(earlier)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        print(f"compose-test: == {name}", flush=True)
        start = time.monotonic()
        yield
        seconds = time.monotonic() - start
        print(f"compose-test: == {name}: {seconds:.1f} s", flush=True)
        self.lines.append(f"{name}: {seconds:.1f} s")

    def note(self, line: str) -> None:
        print(f"compose-test: {line}", flush=True)
        self.lines.append(line)

    def report(self) -> None:
        print("compose-test: timings")
        for line in self.lines:
            print(f"compose-test:   {line}")


def client(timeout: float = 120) -> openai.OpenAI:
    # max_retries=0: a 503 must be seen as such, not retried away by the client.
    return openai.OpenAI(base_url=f"{GATEWAY}/v1", api_key="compose-test", max_retries=0, timeout=timeout)


def png_size(data: bytes, what: str) -> tuple[int, int]:
    check(data.startswith(b"\x89PNG\r\n\x1a\n"), f"{what}: not a PNG (first bytes {data[:8]!r})")
    with Image.open(io.BytesIO(data)) as picture:
        return picture.size


def expect_picture(data: bytes, what: str) -> None:
    size = png_size(data, what)
    check(size == (128, 128), f"{what}: a {size[0]}x{size[1]} picture, asked for {SIZE}")


# -- phases ---------------------------------------------------------------------------------------------------------

def build(no_cache: bool) -> int:
    compose_cmd("build", *(["--no-cache"] if no_cache else []), "dit", timeout=1800)
    # The image this build replaced, untagged now; only ardit's (the Dockerfile's label), never another project's.
    docker("image", "prune", "--force", "--filter", "label=org.opencontainers.image.title=ardit")
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    return size


def up(*extra: str) -> None:
    result = compose_cmd("up", "--detach", "--wait", "--no-build", *extra, timeout=900, check_rc=False)
    if result.returncode != 0:
        raise ScenarioFailed(f"compose up --wait exited {result.returncode}:\n{result.stderr[-4000:]}\n{service_states()}")


def service_states() -> str:
    return compose_cmd("ps", "--all", "--format", "{{.Name}}\t{{.State}}\t{{.Status}}", check_rc=False).stdout


def b64_json_request() -> bytes:
    answer = client().images.generate(model=MODEL, prompt=PROMPT, size=SIZE, response_format="b64_json")
    check(answer.data and answer.data[0].b64_json, f"b64_json request: no image in the answer: {answer}")
    assert answer.data is not None and answer.data[0].b64_json is not None
    picture = base64.b64decode(answer.data[0].b64_json)
    expect_picture(picture, "b64_json request")
    return picture


def edit_request(picture: bytes) -> None:
    """The drawn picture sent back with an instruction: the answer is the edited picture, at the input's size."""
    answer = client().images.edit(model=MODEL, image=("scene.png", picture, "image/png"), prompt=EDIT,
                                  response_format="b64_json")
    check(answer.data and answer.data[0].b64_json, f"edit request: no image in the answer: {answer}")
    assert answer.data is not None and answer.data[0].b64_json is not None
    edited = base64.b64decode(answer.data[0].b64_json)
    expect_picture(edited, "edit request")
    check(edited != picture, "edit request: the answer is the input picture unchanged")


def url_request() -> None:
    answer = client().images.generate(model="dall-e-2", prompt=PROMPT, size=SIZE, response_format="url")
    check(answer.data and answer.data[0].url, f"url request: no url in the answer: {answer}")
    assert answer.data is not None and answer.data[0].url is not None
    url = answer.data[0].url
    fetched = httpx.get(url, timeout=30)
    check(fetched.status_code == 200, f"url request: GET {url} answered {fetched.status_code}: {fetched.text[:300]}")
    expect_picture(fetched.content, f"url request ({url})")


def streamed_request() -> None:
    events = list(client().images.generate(model=MODEL, prompt=PROMPT, size=SIZE, stream=True, partial_images=2))
    kinds = [event.type for event in events]
    expected = ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    check(kinds == expected, f"streamed request: events {kinds}, expected {expected}")
    for index, event in enumerate(events):
        expect_picture(base64.b64decode(event.b64_json), f"streamed request, event {index} ({event.type})")


def status_of_one_request(timeout: float = 30) -> int:
    """The HTTP status of one b64_json request (0: no answer at all)."""
    try:
        client(timeout).images.generate(model=MODEL, prompt=PROMPT, size=SIZE, extra_body={"num_inference_steps": 4})
        return 200
    except openai.APIStatusError as error:
        return error.status_code
    except openai.APIConnectionError:
        return 0


def container_ids(service: str) -> list[str]:
    return compose_cmd("ps", "--quiet", service).stdout.split()


def inspect(container: str, template: str) -> str:
    return docker("inspect", "--format", template, container).stdout.strip()


def crash_dit(timings: Timings) -> None:
    (dit,) = container_ids("dit")
    pid = int(inspect(dit, "{{.State.Pid}}"))
    restarts = int(inspect(dit, "{{.RestartCount}}"))
    check(pid > 0, f"the DiT container {dit[:12]} has no process")
    try:
        os.kill(pid, signal.SIGKILL)  # dockerd's pid namespace is this one: CI and `make compose-test` run as root
    except PermissionError as error:
        raise ScenarioFailed(f"cannot SIGKILL the DiT's process {pid} ({error}): run as root, beside dockerd") from error
    killed = time.monotonic()
    statuses: list[tuple[float, int]] = []
    while time.monotonic() - killed < RECOVERY_TIMEOUT_S:
        status = status_of_one_request()
        statuses.append((time.monotonic() - killed, status))
        if status == 200 and any(code == 503 for _, code in statuses):
            break
        time.sleep(0.5)
    seen = ", ".join(f"{at:.1f} s: {code}" for at, code in statuses)
    print(f"compose-test: after the kill: {seen}", flush=True)
    check(any(code == 503 for _, code in statuses), f"no 503 from the gateway while the DiT was down ({seen})")
    check(statuses[-1][1] == 200, f"the gateway did not answer 200 again within {RECOVERY_TIMEOUT_S:.0f} s ({seen})")
    first_503 = next(at for at, code in statuses if code == 503)
    timings.note(f"DiT crash: first 503 {first_503:.1f} s after the kill, 200 again after {statuses[-1][0]:.1f} s")
    check(container_ids("dit") == [dit], f"the DiT came back as another container: {container_ids('dit')} (was {dit})")
    now_restarts = int(inspect(dit, "{{.RestartCount}}"))
    check(now_restarts == restarts + 1, f"the DiT container's RestartCount is {now_restarts}, was {restarts}: not restarted by its policy")
    # Healthy again too, by its own health check (compose's view of it).
    deadline = time.monotonic() + 120
    while inspect(dit, "{{.State.Health.Status}}") != "healthy":
        check(time.monotonic() < deadline, f"the restarted DiT is not healthy: {inspect(dit, '{{json .State.Health}}')}")
        time.sleep(1)


def completed_counts(service: str, port: int, counter: str) -> list[float]:
    """The finished-work counter of each replica of ``service`` (compose's --index is 1-based)."""
    counts = []
    for index in range(1, len(container_ids(service)) + 1):
        script = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode())"
        text = compose_cmd("exec", "-T", "--index", str(index), service, "python", "-c", script, timeout=60).stdout
        match = re.search(rf"^{counter} (\S+)$", text, re.MULTILINE)
        check(match, f"{service} replica {index}: no {counter} in its metrics:\n{text[:1500]}")
        assert match is not None
        counts.append(float(match.group(1)))
    return counts


def scaled_requests(timings: Timings) -> None:
    up("--scale", "ar=2", "--scale", "dit=2")
    for service in ("ar", "dit"):
        check(len(container_ids(service)) == 2, f"--scale {service}=2 gave {len(container_ids(service))} containers")
    before = {service: completed_counts(service, port, counter) for service, port, counter in REPLICA_COUNTERS}
    start = time.monotonic()
    sent = 0
    with ThreadPoolExecutor(4) as pool:
        while True:
            statuses = list(pool.map(lambda _: status_of_one_request(60), range(4)))
            sent += len(statuses)
            check(all(code == 200 for code in statuses), f"requests to the scaled project answered {statuses}")
            now = {service: completed_counts(service, port, counter) for service, port, counter in REPLICA_COUNTERS}
            served = {service: [a - b for a, b in zip(now[service], before[service], strict=True)] for service in now}
            if all(count > 0 for counts in served.values() for count in counts):
                break
            check(time.monotonic() - start < SCALE_TIMEOUT_S,
                  f"after {sent} requests in {SCALE_TIMEOUT_S:.0f} s some replica has served none: {served}")
            time.sleep(1)
    timings.note(f"scaled: every replica served within {sent} requests: {served}")


def down() -> None:
    compose_cmd("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)


def leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        kind: docker(*command, "--filter", label, "--quiet").stdout.split()
        for kind, command in (("containers", ("ps", "--all")), ("networks", ("network", "ls")), ("volumes", ("volume", "ls")))
    }


def save_logs() -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "compose-logs.txt").write_text(compose_cmd("logs", "--no-color", "--timestamps", check_rc=False).stdout)
    (ARTIFACTS / "compose-ps.txt").write_text(service_states())
    print(f"compose-test: the project's logs: {ARTIFACTS / 'compose-logs.txt'}", file=sys.stderr)


def port_8000_is_free() -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", 8000)) != 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down-only", action="store_true", help="take a leftover test project down, and nothing else")
    parser.add_argument("--timings-file", type=Path, help="earlier phases' timings, one a line (tests/compose/run.sh)")
    parser.add_argument("--no-cache", action="store_true", help="build the image without the builder's cache")
    args = parser.parse_args(argv)
    if args.down_only:
        down()
        return 0
    earlier = args.timings_file.read_text().splitlines() if args.timings_file and args.timings_file.exists() else []
    timings = Timings(earlier)
    check(port_8000_is_free(), "something already listens on 127.0.0.1:8000 (a `make up` or another compose project?)")
    drawn: list[bytes] = []
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("b64_json request", lambda: drawn.append(b64_json_request())),
        ("edit request (the drawn picture, multipart)", lambda: edit_request(drawn[0])),
        ("url request (and its URL fetched)", url_request),
        ("streamed request (2 partial images)", streamed_request),
        ("DiT killed, restarted by compose: 503 then 200", lambda: crash_dit(timings)),
        ("--scale ar=2 --scale dit=2: every replica serves", lambda: scaled_requests(timings)),
    ]
    failed = False
    try:
        with timings.phase("compose build (image from the base and wheelhouse/, no network)"):
            size = build(args.no_cache)
        timings.note(f"image {IMAGE}: {size / 1e6:.0f} MB")
        with timings.phase("compose up --wait"):
            up()
        for name, step in steps:
            with timings.phase(name):
                step()
    except BaseException:
        failed = True
        save_logs()
        raise
    finally:
        with timings.phase("compose down -v"):
            down()
        left = leftovers()
        timings.report()
        if not failed:
            check(not any(left.values()), f"compose down -v left some of the project behind: {left}")
    print("compose-test: passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ScenarioFailed as failure:
        print(f"compose-test: FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
