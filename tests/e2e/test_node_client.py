"""The official openai npm client (tests/e2e/node: the version package-lock.json pins) against the tiny Dev stack:
images.generate, images.edit with one image and with several, a streamed edit, and a bad image as the client's
BadRequestError. tests/e2e/node/images.mjs makes the calls and prints what it got; the checks are here.

`npm ci` installs the client when node_modules lacks it. Without node (20 or newer) and npm the tests skip on a laptop
and fail in CI (``CI=true``), where .ci/run installs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_edits
from tests.e2e.conftest import ROOT, Stack
from tests.e2e.test_edits import decoded, png

dev_stack = test_edits.dev_stack  # the tiny Dev stack, one for this module (its fixture, not a copy)

NODE_DIR = ROOT / "tests" / "e2e" / "node"
PACKAGE = json.loads((NODE_DIR / "package.json").read_text())
PINNED = PACKAGE["dependencies"]["openai"]
NODE_MAJOR = int(PACKAGE["engines"]["node"].removeprefix(">="))


@pytest.fixture(scope="module")
def node() -> str:
    """node's path, once the pinned openai package is installed (npm ci from package-lock.json)."""
    node_path, npm_path = shutil.which("node"), shutil.which("npm")
    message = "node or npm missing: apt-get install nodejs npm"
    if node_path is not None and npm_path is not None:
        version = subprocess.run([node_path, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
        # openai 6.x uploads need the global File class, which Node has from 20 (Debian 12's nodejs is 18)
        message = "" if int(version.lstrip("v").split(".")[0]) >= NODE_MAJOR else f"node {version} is older than {NODE_MAJOR}"
    if message:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI must run the Node client: .ci/run installs node and npm)")
        pytest.skip(message)
    assert npm_path is not None and node_path is not None
    installed = NODE_DIR / "node_modules" / "openai" / "package.json"
    if not installed.is_file() or json.loads(installed.read_text())["version"] != PINNED:
        done = subprocess.run([npm_path, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
    return node_path


def run(node: str, stack: Stack, *args: str | Path) -> tuple[int, dict[str, Any]]:
    """images.mjs's exit status and the JSON it printed."""
    done = subprocess.run([node, "images.mjs", f"{stack.gateway_url}/v1", *map(str, args)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip(), f"images.mjs printed nothing (exit {done.returncode}):\n{done.stderr}"
    return done.returncode, json.loads(done.stdout)


def ok(node: str, stack: Stack, *args: str | Path) -> dict[str, Any]:
    returncode, answer = run(node, stack, *args)
    assert returncode == 0 and "error" not in answer, answer
    return answer


def inputs(directory: Path, *sizes: tuple[int, int]) -> list[Path]:
    paths = []
    for i, (width, height) in enumerate(sizes):
        paths.append(directory / f"in-{i}.png")
        paths[-1].write_bytes(png(width, height, (40 * i, 200, 40)))
    return paths


def test_the_pinned_client_is_the_one_installed(node: str) -> None:
    done = subprocess.run([node, "-e", "import('openai/version').then((m) => console.log(m.VERSION))"],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == PINNED, done.stderr


def test_generate_returns_pngs_of_the_asked_size(node: str, dev_stack: Stack) -> None:
    answer = ok(node, dev_stack, "generate", dev_stack.model_dir.name, "96x48", 2)
    assert answer["size"] == "96x48" and len(answer["images"]) == 2
    for b64 in answer["images"]:
        image = decoded(b64)
        assert image.format == "PNG" and image.size == (96, 48)


def test_one_image_edit_takes_the_input_size(node: str, dev_stack: Stack, tmp_path: Path) -> None:
    answer = ok(node, dev_stack, "edit", 1, *inputs(tmp_path, (80, 48)))
    (b64,) = answer["images"]
    assert decoded(b64).format == "PNG" and decoded(b64).size == (80, 48)
    assert answer["size"] == "80x48"


def test_several_images_as_image_array_take_the_last_ones_size(node: str, dev_stack: Stack, tmp_path: Path) -> None:
    answer = ok(node, dev_stack, "edit", 2, *inputs(tmp_path, (64, 64), (48, 80)))
    assert len(answer["images"]) == 2
    assert [decoded(b64).size for b64 in answer["images"]] == [(48, 80), (48, 80)]
    assert answer["size"] == "48x80"


def test_a_streamed_edit_ends_with_the_completed_image(node: str, dev_stack: Stack, tmp_path: Path) -> None:
    events = ok(node, dev_stack, "stream-edit", *inputs(tmp_path, (64, 48)))["events"]
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "image_edit.completed" and kinds.count("image_edit.completed") == 1
    assert set(kinds[:-1]) <= {"image_edit.partial_image"}
    assert events[-1]["size"] == "64x48" and decoded(events[-1]["b64_json"]).size == (64, 48)


@pytest.mark.parametrize(("data", "words"), [
    (b"GIF89a not really", "not an image"),
    (png(64, 64, (1, 2, 3, 4), "RGBA"), "alpha channel"),
])
def test_a_bad_image_is_a_bad_request_error_naming_the_problem(node: str, dev_stack: Stack, tmp_path: Path,
                                                                data: bytes, words: str) -> None:
    (tmp_path / "bad.png").write_bytes(data)
    returncode, answer = run(node, dev_stack, "edit", 1, tmp_path / "bad.png")
    error = answer.get("error")
    assert returncode == 1 and error is not None, answer
    assert error["name"] == "BadRequestError" and error["badRequest"] and error["status"] == 400
    assert words in error["message"], error


def test_the_readme_names_the_pinned_version() -> None:
    major_minor = ".".join(PINNED.split(".")[:2])
    assert f"| openai Node {major_minor} (" in (ROOT / "README.md").read_text()
