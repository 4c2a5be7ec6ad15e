"""Popular OpenAI image clients, left at their defaults, against the stack `make up` starts.

One ``python -m tools.run_all`` (the Dev shapes model by default, as `make up` serves) serves the whole module on free
loopback ports. The clients send OpenAI's model names (dall-e-2, dall-e-3, gpt-image-1), sizes (512x512, 1024x1024) and
fields (style, quality, background, ...) unasked: the stack answers them through its model aliases, by enlarging the
shapes model's 128x128 drawing, and by naming the fields that change nothing here; every answer's pictures are
exactly the size it states.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tools.local_stack import ROOT, free_port
from tools.run_all import DEFAULT_ALIASES, DEFAULT_MODEL_DIR

PROMPT = "a red circle on the left on a white background"
START_TIMEOUT_S = 180
API_KEY = "sk-anything"  # the stack is open; clients insist on sending a key
SERVED = DEFAULT_MODEL_DIR.name  # the served model's id: its directory's name ("shapes-dev")


class MakeUpStack:
    """`make up`'s launcher as a subprocess on free ports, its console in a log file."""

    def __init__(self, log: Path):
        self.ports = [free_port() for _ in range(3)]
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        clean = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tools.run_all", "--gateway-port", str(self.ports[0]),  # the default model
                 "--ar-port", str(self.ports[1]), "--dit-port", str(self.ports[2])],
                cwd=ROOT, env={**clean, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tools.run_all exited with {self.process.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the stack was not healthy within {START_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def make_up(tmp_path_factory) -> Iterator[MakeUpStack]:
    stack = MakeUpStack(tmp_path_factory.mktemp("make-up") / "run_all.log")
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


def png_size(data: bytes) -> tuple[int, int]:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image.size


def red_on_the_left(data: bytes) -> bool:
    """The shapes model's drawing survived the enlargement: the left half holds much more red than the right."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    red = (pixels[..., 0] > 150) & (pixels[..., 1] < 100) & (pixels[..., 2] < 100)
    half = red.shape[1] // 2
    left, right = red[:, :half].mean(), red[:, half:].mean()
    return left > 0.02 and left > 4 * right


def test_open_webui_request_shape(make_up: MakeUpStack) -> None:
    """Open WebUI's "openai" image engine, reproduced with httpx (Open WebUI itself is too heavy to install here).

    The request is the one open-webui's ``backend/open_webui/routers/images.py`` builds when the admin leaves the
    model and size empty: JSON ``{model: "dall-e-2", prompt, n: 1, size: "512x512", response_format: "b64_json"}``
    with the configured key as a bearer token; it then reads ``data[i].b64_json`` (or fetches ``data[i].url``).
    """
    body = {"model": "dall-e-2", "prompt": PROMPT, "n": 1, "size": "512x512", "response_format": "b64_json"}
    response = httpx.post(f"{make_up.url}/v1/images/generations", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["size"] == "512x512" and answer["model"] == SERVED
    data = base64.b64decode(answer["data"][0]["b64_json"])
    assert png_size(data) == (512, 512)
    assert red_on_the_left(data)


def test_langchain_dalle_wrapper_defaults(make_up: MakeUpStack) -> None:
    """langchain-community's DallEAPIWrapper at its defaults (model dall-e-2, size 1024x1024, n 1): it reads
    ``data[0].url`` without asking for one, as OpenAI answers DALL-E models."""
    from langchain_community.utilities.dalle_image_generator import DallEAPIWrapper

    wrapper = DallEAPIWrapper(api_key=API_KEY, base_url=f"{make_up.url}/v1", max_retries=0)
    assert (wrapper.model_name, wrapper.size, wrapper.n) == ("dall-e-2", "1024x1024", 1)
    url = wrapper.run(PROMPT)
    assert url.startswith(make_up.url), url
    image = httpx.get(url, timeout=30)
    assert image.status_code == 200
    assert png_size(image.content) == (1024, 1024)
    assert red_on_the_left(image.content)


@pytest.fixture(scope="module")
def litellm_module():
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # offline: no cost map fetched at import
    import litellm

    return litellm


def image_of(item) -> bytes:
    """One LiteLLM image's bytes, fetched from its url or decoded from its b64_json."""
    return httpx.get(item.url, timeout=30).content if item.url else base64.b64decode(item.b64_json)


def test_litellm_image_generation(make_up: MakeUpStack, litellm_module) -> None:
    """litellm.image_generation with an ``openai/`` model and ``api_base``. At its defaults it sends only model and
    prompt (seen on the wire), answered at the model's default size; the fields it forwards when given (size,
    quality, output_format, background) are honoured, and a value ardit cannot honour is a clear 400."""
    call = dict(model="openai/dall-e-2", prompt=PROMPT, api_base=f"{make_up.url}/v1", api_key=API_KEY, max_retries=0)
    plain = litellm_module.image_generation(**call)
    assert Image.open(io.BytesIO(image_of(plain.data[0]))).size == (128, 128)

    result = litellm_module.image_generation(
        **call, size="1024x1024", n=1, quality="hd", output_format="webp", background="opaque"
    )
    image = Image.open(io.BytesIO(image_of(result.data[0])))
    assert (image.format, image.size) == ("WEBP", (1024, 1024))

    with pytest.raises(litellm_module.BadRequestError, match="background"):
        litellm_module.image_generation(**call, size="512x512", background="transparent")


def test_unknown_model_is_404_naming_served_model_and_aliases(make_up: MakeUpStack) -> None:
    response = httpx.post(f"{make_up.url}/v1/images/generations", json={"model": "stable-diffusion-3", "prompt": PROMPT},
                          timeout=60)
    assert response.status_code == 404, response.text
    message = response.json()["error"]["message"]
    assert SERVED in message and "dall-e-2" in message and "gpt-image-1" in message


def test_models_list_the_aliases_as_such(make_up: MakeUpStack) -> None:
    models = httpx.get(f"{make_up.url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["ardit"]["alias_of"]) for m in models] == [
        (SERVED, None), *((alias, SERVED) for alias in DEFAULT_ALIASES)
    ]
    assert {"gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5", "dall-e-2", "dall-e-3"} <= set(DEFAULT_ALIASES)
    assert models[0]["ardit"]["max_upscale"] == 8


def openai_client(make_up: MakeUpStack):
    from openai import OpenAI

    return OpenAI(base_url=f"{make_up.url}/v1", api_key=API_KEY, max_retries=0)


def test_librechat_image_gen_oai_request(make_up: MakeUpStack) -> None:
    """LibreChat's "OpenAI Image Tools" (api/app/clients/tools/structured/OpenAIImageTools.js) with the tool's
    defaults, through the official client as LibreChat's openai package sends it: model gpt-image-1, n 1, background
    auto, output_format png (output_compression left out for png), quality auto, size auto. It reads
    ``data[0].b64_json``. The size it may also pick, 1024x1024, is answered at that size."""
    client = openai_client(make_up)
    for size, pixels in (("auto", (128, 128)), ("1024x1024", (1024, 1024))):
        raw = client.images.with_raw_response.generate(
            model="gpt-image-1", prompt=PROMPT, n=1, background="auto", output_format="png", quality="auto", size=size,
        )
        assert "x-ardit-ignored-fields" not in raw.headers  # every field it sends takes effect
        result = raw.parse()
        data = base64.b64decode(result.data[0].b64_json)
        assert png_size(data) == pixels and result.size == "{}x{}".format(*pixels)
        assert result.model_extra["model"] == SERVED and result.model_extra["ignored_fields"] == []
        assert red_on_the_left(data)


def test_librechat_dalle3_request(make_up: MakeUpStack) -> None:
    """LibreChat's DALL-E 3 tool (api/app/clients/tools/structured/DALLE3.js): model dall-e-3, quality hd, style vivid,
    size 1024x1024, n 1, no response_format; it reads ``data[0].url``, as OpenAI answers DALL-E 3 by default. style
    changes nothing here, and the answer says so; quality hd is the model's 'hd' step preset."""
    raw = openai_client(make_up).images.with_raw_response.generate(
        model="dall-e-3", prompt=PROMPT, quality="hd", style="vivid", size="1024x1024", n=1,
    )
    assert raw.headers["x-ardit-ignored-fields"] == "style"
    result = raw.parse()
    assert result.size == "1024x1024" and result.quality == "hd" and result.model_extra["ignored_fields"] == ["style"]
    image = httpx.get(result.data[0].url, timeout=30)
    assert image.status_code == 200 and png_size(image.content) == (1024, 1024)
    assert red_on_the_left(image.content)


def test_every_openai_field_in_one_request(make_up: MakeUpStack) -> None:
    """Every parameter of openai-python 3.63's images.generate at once (OpenAI's whole request body): a 200 at the asked
    size and format, naming the fields that changed nothing."""
    raw = openai_client(make_up).images.with_raw_response.generate(
        prompt=PROMPT, model="gpt-image-1", n=2, size="512x512", quality="xhigh", response_format="b64_json",
        output_format="jpeg", output_compression=85, background="opaque", moderation="low", style="natural",
        complexity="medium", frame_count=9, frame_duration_ms=200, svg={"model": "any", "reasoning": {"effort": "low"}},
        partial_images=3, stream=False, user="user-1234", safety_identifier="hash-of-user",
    )
    ignored = ["complexity", "frame_count", "frame_duration_ms", "moderation", "partial_images", "style", "svg"]
    assert raw.headers["x-ardit-ignored-fields"] == ", ".join(ignored)
    result = raw.parse()
    assert result.model_extra["ignored_fields"] == ignored
    assert (result.size, result.quality, result.output_format, result.background) == ("512x512", "xhigh", "jpeg", "opaque")
    assert result.model_extra["knobs"]["num_inference_steps"] == 50  # xhigh: the model's highest preset (high)
    for item in result.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert (image.format, image.size) == ("JPEG", (512, 512))


def test_a_streamed_request_names_the_fields_without_effect_too(make_up: MakeUpStack) -> None:
    """With stream, response_format url changes nothing (the events carry b64_json): the header and the stream's
    ardit comments say so, and the official client still reads the images."""
    client = openai_client(make_up)
    with client.images.with_streaming_response.generate(
        prompt=PROMPT, model="gpt-image-1", size="256x256", stream=True, partial_images=1, response_format="url",
        style="vivid",
    ) as response:
        assert response.headers["x-ardit-ignored-fields"] == "response_format, style"
        text = response.read().decode()
    started = next(line for line in text.splitlines() if line.startswith(": ardit.started "))
    assert '"ignored_fields":["response_format","style"]' in started
    assert "event: image_generation.completed" in text


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [("style", "loud", "'vivid', 'natural'"), ("quality", "ultra", "'hd'"), ("output_compression", 101, "0 to 100")],
)
def test_an_invalid_openai_value_is_a_400_naming_the_field_and_what_it_accepts(make_up, field, value, accepted) -> None:
    from openai import BadRequestError

    body = {"output_format": "jpeg"} if field == "output_compression" else {}
    with pytest.raises(BadRequestError) as refused:
        openai_client(make_up).images.generate(model="dall-e-3", prompt=PROMPT, extra_body={**body, field: value})
    error = refused.value.body
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert f"'{field}' must be" in error["message"] and accepted in error["message"], error["message"]


def test_a_size_three_times_the_drawing_is_answered_at_that_size(make_up: MakeUpStack) -> None:
    """384x384 is above the 256 the model draws at most, and 3 x 128: drawn at 128x128 and enlarged 3 times."""
    response = httpx.post(f"{make_up.url}/v1/images/generations",
                          json={"model": "dall-e-3", "prompt": PROMPT, "size": "384x384", "response_format": "b64_json"},
                          timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["size"] == "384x384"
    assert png_size(base64.b64decode(response.json()["data"][0]["b64_json"])) == (384, 384)


def test_a_size_no_factor_reaches_is_refused(make_up: MakeUpStack) -> None:
    """1792x1024 (a DALL-E 3 size) would need 14 x 128 wide, more than the factor of 8 the checkpoint allows."""
    response = httpx.post(f"{make_up.url}/v1/images/generations",
                          json={"model": "dall-e-3", "prompt": PROMPT, "size": "1792x1024"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "size"
    assert "enlarged" in response.json()["error"]["message"]
