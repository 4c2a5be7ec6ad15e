"""The MammothModa2-Dev layout served end to end: the tiny Dev model (``tools.make_tiny --dev``) through the real
services and gateway, with the real openai client; and a Dev AR beside a Preview DiT refused before rendering."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from tests.e2e.conftest import Stack, running_stack
from tools.make_tiny import make_tiny_dev


@pytest.fixture(scope="module")
def dev_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models") / "tiny-dev"
    make_tiny_dev(root)
    return root


@pytest.fixture(scope="module")
def dev_stack(dev_model: Path, tmp_path_factory) -> Iterator[Stack]:
    with running_stack(dev_model, tmp_path_factory.mktemp("logs")) as running:
        yield running


def test_models_say_the_directory_is_dev(dev_stack: Stack) -> None:
    (card,) = httpx.get(f"{dev_stack.gateway_url}/v1/models", timeout=10).json()["data"]
    assert card["id"] == "tiny-dev"
    assert (card["ardit"]["family"], card["ardit"]["member"]) == ("mammothmoda2", "dev")


@pytest.mark.parametrize("size", ["64x64", "96x48"])
def test_a_dev_image_of_the_asked_size(dev_stack: Stack, size: str) -> None:
    client = OpenAI(base_url=f"{dev_stack.gateway_url}/v1", api_key="unused", max_retries=0)
    answer = client.images.generate(model="tiny-dev", prompt="a red circle", size=size,  # type: ignore[arg-type]
                                    response_format="b64_json", extra_body={"seed": 3})
    assert answer.data is not None
    image = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json or "")))
    width, height = (int(side) for side in size.split("x"))
    assert image.format == "PNG" and image.size == (width, height)
    timings = (answer.model_extra or {})["timings"]
    grid_w, grid_h = width // 16, height // 16  # the tiny model's 16 pixels a token
    assert (timings["ar_grid_width"], timings["ar_grid_height"]) == (grid_w, grid_h)
    # every grid position and the look-ahead, which the released Dev split feeds (<|image end|>) for its state
    assert timings["ar_tokens"] == grid_h * (grid_w + 1) + 1


def test_the_same_seed_draws_the_same_dev_image(dev_stack: Stack) -> None:
    body = {"prompt": "a blue square", "size": "64x64", "response_format": "b64_json", "seed": 11}
    first, second = (httpx.post(f"{dev_stack.gateway_url}/v1/images/generations", json=body, timeout=120)
                     for _ in range(2))
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["data"][0]["b64_json"] == second.json()["data"][0]["b64_json"]


def test_a_dev_ar_beside_a_preview_dit_is_refused(dev_model: Path, tiny_model: Path, tmp_path_factory) -> None:
    with running_stack(dev_model, tmp_path_factory.mktemp("logs"), dit_model_dir=tiny_model) as mixed:
        answer = httpx.post(f"{mixed.gateway_url}/v1/images/generations",
                            json={"prompt": "a red circle", "size": "64x64"}, timeout=60)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_mismatch"
    assert "'tiny-dev'" in error["message"] and "'tiny'" in error["message"]
