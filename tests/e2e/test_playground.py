"""The playground page (GET /) in a real headless Chromium, driven by Selenium.

Debian's ``chromium`` and ``chromium-driver`` packages are used, never a downloaded browser: the driver's
path is given explicitly, so Selenium Manager stays out. Without them the tests skip on a laptop, and fail
in CI (``CI=true``), where .ci/run installs them. Screenshots go to ``$ARDIT_SCREENSHOTS`` (or a temporary
directory, printed).

The first test types a prompt into the page served by the real stack and waits for the image; the second
serves the same page beside a stand-in that streams OpenAI's event format (with ``ardit.progress`` events
and an ``error`` event), so the page's stream reader is tested whatever the gateway under test does.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from gateway import playground
from tests.e2e.conftest import running_stack
from tools.local_stack import ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 180


@pytest.fixture(scope="module")
def browser():
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.is_file()]
    if missing:
        message = f"{', '.join(missing)} missing: apt-get install chromium chromium-driver"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI must run the browser test: .ci/run installs them)")
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    directory = Path(os.environ.get("ARDIT_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"playground screenshots in {directory}")
    return directory


class Page:
    """The playground's elements by id, and waits on what a user would see."""

    def __init__(self, driver, screenshots: Path, prefix: str):
        self.driver = driver
        self.screenshots = screenshots
        self.prefix = prefix

    def __getitem__(self, element_id: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def fill(self, **fields: str) -> None:
        for element_id, value in fields.items():
            element = self[element_id]
            element.clear()
            element.send_keys(value)

    def wait(self, condition, what: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(self.driver, WAIT_S, poll_frequency=0.05).until(lambda _: condition(), message=what)

    def wait_for_result(self) -> None:
        self.wait(lambda: self["generate"].is_enabled() and ("size" in self["details"].text or self["error"].text),
                  "the request to finish")

    def shot(self, name: str) -> Path:
        path = self.screenshots / f"{self.prefix}-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def js(self, script: str):
        return self.driver.execute_script(script)

    def result_size(self) -> tuple[int, int]:
        return tuple(self.js("const i = document.getElementById('result'); return [i.naturalWidth, i.naturalHeight];"))

    def record_arrivals(self) -> None:
        """From now on, window.arrivals lists what appears, in order: "preview" per partial image, "image" at the end."""
        self.js("""
            window.arrivals = [];
            new MutationObserver((changes) => changes.forEach((c) => c.addedNodes.forEach(() => arrivals.push("preview"))))
                .observe(document.getElementById("previews"), {childList: true});
            new MutationObserver(() => document.getElementById("result").hasAttribute("src") && arrivals.push("image"))
                .observe(document.getElementById("result"), {attributeFilter: ["src"]});
        """)

    def arrivals(self) -> list[str]:
        return self.js("return window.arrivals")

    def previews(self) -> list[tuple[int, int]]:
        return [tuple(size) for size in self.js(
            "return [...document.querySelectorAll('#previews img')].map(i => [i.naturalWidth, i.naturalHeight]);")]


def test_type_a_prompt_and_get_an_image_of_the_chosen_size(stack, browser, screenshots):
    page = Page(browser, screenshots, "stack")
    browser.get(f"{stack.gateway_url}/")
    page.wait(lambda: page["model"].text.startswith("model "), "the model card to load")
    assert page["size"].get_attribute("value") == "256x256"  # the model's default size, from GET /v1/models
    page.fill(prompt="a lighthouse at dusk, oil painting", negative_prompt="blurry", size="384x256", seed="7",
              steps="4", guidance="3")
    page.shot("1-filled")
    page.record_arrivals()
    page["generate"].click()
    page.wait(lambda: not page["generate"].is_enabled(), "the request to start")
    page.wait_for_result()
    page.shot("2-done")
    assert page["error"].text == ""
    assert page.result_size() == (384, 256)
    assert "seed 7" in page["details"].text
    assert page.js("return document.getElementById('progress').value") == 1
    if page.js("return canStream"):  # the gateway streams: the previews came first, at the chosen size
        assert 1 <= len(page.previews()) <= 3 and set(page.previews()) == {(384, 256)}
        assert page.arrivals() == ["preview"] * len(page.previews()) + ["image"]
    else:  # the gateway refused stream: true and the page fell back to one plain request
        assert page.previews() == [] and page.arrivals() == ["image"]
        assert "denoise" in page["details"].text  # the services' timings, from the JSON answer

    # a bad request: the page shows the API's own message
    page.fill(size="100x100")
    page["generate"].click()
    page.wait_for_result()
    page.shot("3-error")
    expected = httpx.post(f"{stack.gateway_url}/v1/images/generations", timeout=60, json={
        "prompt": "a lighthouse at dusk, oil painting", "size": "100x100", "num_inference_steps": 4}).json()
    assert page["error"].text == expected["error"]["message"]
    assert page["status"].text == "Failed."


@pytest.fixture(scope="module")
def shapes_stack(tmp_path_factory):
    """The three services on the shapes model, the one `make up` serves (the README's picture is of it)."""
    with running_stack(ROOT / "train" / "checkpoints" / "shapes", tmp_path_factory.mktemp("shapes-logs")) as running:
        yield running


def test_the_shapes_model_at_an_openai_client_size(shapes_stack, browser, screenshots):
    """The shapes model at 512x512, a size OpenAI clients send: drawn at 128x128 and enlarged, streamed previews
    and the image at the size chosen. Its ``shapes-2-done`` screenshot is docs/playground.png."""
    page = Page(browser, screenshots, "shapes")
    browser.set_window_size(1280, 1100)  # room for the 512x512 image and its details below the previews
    browser.get(f"{shapes_stack.gateway_url}/")
    page.wait(lambda: page["model"].text.startswith("model shapes"), "the model card to load")
    assert page["size"].get_attribute("value") == "128x128"
    offered = page.js("return [...document.querySelectorAll('#sizes option')].map(o => o.value)")
    # the enlarged sizes are offered (max_upscale 8 of 128), 2048 (16 x 128) is not
    assert {"512x512", "1024x1024"} <= set(offered) and "2048x2048" not in offered
    page.fill(prompt="a small red star at the top, blue background", size="512x512", seed="7")
    page.record_arrivals()
    page["generate"].click()
    page.wait(lambda: not page["generate"].is_enabled(), "the request to start")
    page.wait_for_result()
    page.shot("2-done")
    assert page["error"].text == ""
    assert page.result_size() == (512, 512)
    if page.js("return canStream"):
        assert set(page.previews()) == {(512, 512)}
    browser.set_window_size(1280, 860)


# -- the stream reader, against a stand-in that speaks OpenAI's event format ---------------------


def _png(width: int, height: int, shade: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 120, 200)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _news(name: str, data: dict) -> str:
    """ardit's own news travel as SSE comments (the openai client would parse any event's data as an image)."""
    return f": {name} {json.dumps(data)}\n\n"


def standin_app(received: list[dict]) -> FastAPI:
    """The playground beside a streaming Images API as the gateway streams: OpenAI's events for the partial images and
    the image, ardit's progress and summary as comments, keep-alives, [DONE]; or an error event mid-stream."""
    app = FastAPI()
    app.include_router(playground.router)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        knobs = [{"name": "num_inference_steps", "default": 50, "minimum": 1, "maximum": 200},
                 {"name": "text_guidance_scale", "default": 9.0, "minimum": 0, "maximum": 30}]
        return JSONResponse({"object": "list", "data": [{"id": "standin", "ardit": {
            "family": "mammothmoda2", "default_size": "256x256", "max_side": 512, "size_multiple": 16, "knobs": knobs}}]})

    @app.post("/v1/images/generations")
    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        received.append(body)
        width, height = (int(side) for side in body["size"].split("x"))
        common = {"size": body["size"], "quality": "auto", "background": "opaque", "output_format": "png",
                  "created_at": int(time.time())}

        async def events():
            text = _news("ardit.started", {"seed": body["seed"], "n": 1, "size": body["size"], "grid_rows": 4})
            for row in range(1, 5):
                text += _news("ardit.progress", {"image_index": 0, "stage": "ar_decode", "step": row, "total": 4})
            text += ": keep-alive\n\n"
            for index in range(body["partial_images"]):
                text += _news("ardit.progress", {"image_index": 0, "stage": "denoise", "step": index + 1, "total": 4})
                text += _sse("image_generation.partial_image", {"type": "image_generation.partial_image",
                             "b64_json": _png(width, height, 60 * index), "partial_image_index": index, **common})
                if body["prompt"] == "fail":
                    text += _sse("error", {"error": {"message": "dit_service is unavailable: it went away",
                                                     "type": "server_error", "param": None, "code": "unavailable"}})
                    break
            else:
                text += _sse("image_generation.completed", {"type": "image_generation.completed",
                             "b64_json": _png(width, height, 250), **common, "usage": {"total_tokens": 0},
                             "image_index": 0, "seed": body["seed"]})
                text += _news("ardit.completed", {"seed": body["seed"], "seeds": [body["seed"]],
                                                  "timings": {"ar_decode_ms": 40.0, "denoise_ms": 7.0, "total_ms": 52.0}})
                text += "data: [DONE]\n\n"
            for start in range(0, len(text), 777):  # messages split across reads, even mid-line
                yield text[start:start + 777].replace("\n", "\r\n")
                await asyncio.sleep(0.01)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def standin():
    received: list[dict] = []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(standin_app(received), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stand-in did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(timeout=10)


def test_streamed_previews_then_the_image_and_errors_from_the_stream(standin, browser, screenshots):
    url, received = standin
    page = Page(browser, screenshots, "stream")
    browser.get(f"{url}/")
    page.wait(lambda: page["model"].text.startswith("model standin"), "the model card to load")
    page.fill(prompt="a lighthouse", size="320x192", seed="7", steps="4")
    page.record_arrivals()
    page["generate"].click()
    page.wait_for_result()
    page.shot("1-done")
    assert received[-1] == {"prompt": "a lighthouse", "size": "320x192", "n": 1, "response_format": "b64_json",
                            "seed": 7, "num_inference_steps": 4, "stream": True, "partial_images": 3}
    assert page.previews() == [(320, 192)] * 3
    assert page.arrivals() == ["preview", "preview", "preview", "image"]
    assert page.result_size() == (320, 192)
    assert page.js("return document.getElementById('progress').value") == 1
    assert page["status"].text == "Done." and "seed 7" in page["details"].text
    assert "ar decode 40 ms · denoise 7 ms · total 52 ms" in page["details"].text  # from the summary after the image

    page.fill(prompt="fail")
    page["generate"].click()
    page.wait_for_result()
    page.shot("2-error")
    assert page["error"].text == "dit_service is unavailable: it went away"
    assert page.previews() == [(320, 192)]
    assert page.js("return document.getElementById('result').hasAttribute('src')") is False

