"""Image editing end to end: the tiny Dev model (``tools.make_tiny --dev``, its tiny MammothTok included) through the
real services and gateway with the real openai client; the input images' checks, the byte limits (refused before the
AR), and a model that cannot edit (the tiny Preview one) refused naming why."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image

from dit_service.png import chunk
from protos import ar_pb2, ar_pb2_grpc, common_pb2
from tests.e2e.conftest import Stack, running_stack
from tests.e2e.test_playground import Page, browser  # noqa: F401  (browser: the fixture)
from tools.make_tiny import make_tiny_dev

URL = "/v1/images/edits"


@pytest.fixture(scope="module")
def dev_stack(tmp_path_factory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("models") / "tiny-dev"
    make_tiny_dev(root)
    with running_stack(root, tmp_path_factory.mktemp("logs")) as running:
        yield running


def png(width: int, height: int, color=(200, 40, 40), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def padded_png(total_bytes: int, width: int = 320, height: int = 240) -> bytes:
    """A valid PNG of ``total_bytes``: random pixels (stored, not compressed) and a private ancillary chunk of random
    bytes, which decoders skip; cheap to decode at any byte size."""
    import os

    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), os.urandom(width * height * 3)).save(buffer, format="PNG", compress_level=0)
    data = buffer.getvalue()
    filler = os.urandom(max(0, total_bytes - len(data) - 12))
    return data[:33] + chunk(b"arDt", filler) + data[33:]  # after the signature and IHDR


def openai(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=300)


def decoded(b64: str | None) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64 or "")))


def admitted(stack: Stack) -> int:
    with grpc.insecure_channel(stack.ar_address) as channel:
        return ar_pb2_grpc.ImageGeneratorStub(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=10).admitted_total


def test_one_image_edit_takes_the_input_size(dev_stack: Stack) -> None:
    answer = openai(dev_stack).images.edit(image=("in.png", png(96, 64), "image/png"), prompt="make it blue",
                                           extra_body={"seed": 4, "num_inference_steps": 2})
    assert answer.data is not None
    image = decoded(answer.data[0].b64_json)
    assert image.format == "PNG" and image.size == (96, 64)
    assert answer.size == "96x64"


def test_several_images_take_the_last_ones_size(dev_stack: Stack) -> None:
    answer = openai(dev_stack).images.edit(
        image=[("a.png", png(64, 64), "image/png"), ("b.png", png(48, 80, (10, 200, 10)), "image/png")],
        prompt="put the first on the second", n=2, extra_body={"seed": 5, "num_inference_steps": 2})
    assert answer.data is not None and len(answer.data) == 2
    assert all(decoded(item.b64_json).size == (48, 80) for item in answer.data)


def test_a_streamed_edit(dev_stack: Stack) -> None:
    events = list(openai(dev_stack).images.edit(
        image=("in.png", png(64, 48), "image/png"), prompt="add a moon", stream=True, partial_images=1,
        extra_body={"seed": 6, "num_inference_steps": 2}))
    kinds = [event.type for event in events]
    assert kinds[-1] == "image_edit.completed" and set(kinds) <= {"image_edit.partial_image", "image_edit.completed"}
    assert events[-1].size == "64x48" and decoded(events[-1].b64_json).size == (64, 48)


@pytest.mark.parametrize(("data", "words"), [
    (b"", "empty"),
    (b"GIF89a not really", "not an image"),
    (png(64, 64)[:-30], "truncated"),
    (png(64, 64, (1, 2, 3, 4), "RGBA"), "alpha channel"),
    (png(16, 16, 300, "I;16"), "16 bits"),
])
def test_bad_images_are_400s_naming_the_problem(dev_stack: Stack, data: bytes, words: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        openai(dev_stack).images.edit(image=("in.png", data, "image/png"), prompt="edit")
    assert words in str(caught.value) and caught.value.status_code == 400


def test_a_20_mb_png_edits_and_one_over_the_limit_is_refused_before_the_ar(dev_stack: Stack) -> None:
    big = padded_png(20_000_000)
    assert len(big) >= 20_000_000 and Image.open(io.BytesIO(big)).size == (320, 240)
    answer = httpx.post(f"{dev_stack.gateway_url}{URL}", files={"image": ("big.png", big, "image/png")},
                        data={"prompt": "sharpen", "num_inference_steps": "2", "seed": "1"}, timeout=300)
    assert answer.status_code == 200, answer.text
    assert decoded(answer.json()["data"][0]["b64_json"]).size == (320, 240)
    before = admitted(dev_stack)
    over = padded_png(33_554_433)
    refused = httpx.post(f"{dev_stack.gateway_url}{URL}", files={"image": ("over.png", over, "image/png")},
                         data={"prompt": "sharpen"}, timeout=300)
    assert refused.status_code == 400, refused.text
    assert "at most 33554432" in refused.json()["error"]["message"]
    assert admitted(dev_stack) == before  # the gateway refused it: ar_service never queued it


def test_edit_image_over_grpc_refuses_pieces_out_of_order(dev_stack: Stack) -> None:
    request = ar_pb2.GenerateImageRequest(prompt="edit")
    messages = [ar_pb2.EditImageInput(request=request),
                ar_pb2.EditImageInput(image=common_pb2.ImageChunk(index=1, data=png(32, 32), last=True))]
    with grpc.insecure_channel(dev_stack.ar_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(ar_pb2_grpc.ImageGeneratorStub(channel).EditImage(iter(messages), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in order" in caught.value.details()


def test_a_preview_model_refuses_edits_naming_why(stack: Stack) -> None:
    with pytest.raises(BadRequestError) as caught:
        openai(stack).images.edit(image=("in.png", png(64, 64), "image/png"), prompt="edit")
    message = str(caught.value)
    assert "does not edit images" in message and "preview" in message


def test_tiny_dev_model_directory_holds_mammothtok(dev_stack: Stack) -> None:
    from servicekit.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(Path(dev_stack.model_dir))
    assert checkpoint.config["gen_tokenizer_config"]["codebook_size"] == 64
    assert "gen_tokenizer.image_tokenizer.quantize.embedding.weight" in checkpoint.tensor_names("gen_tokenizer.")


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_ardit_edit_writes_the_edited_images(dev_stack: Stack, tmp_path: Path, transport: str) -> None:
    import os
    import subprocess
    import sys

    (tmp_path / "a.png").write_bytes(png(64, 64))
    (tmp_path / "b.png").write_bytes(png(80, 48, (0, 0, 200)))
    where = ["--url", dev_stack.gateway_url] if transport == "rest" else ["--grpc", dev_stack.ar_address]
    env = {key: value for key, value in os.environ.items() if not key.startswith("ARDIT_")}
    done = subprocess.run(
        [sys.executable, "-m", "ardit_cli", *where, "edit", "make it green", "-i", str(tmp_path / "a.png"),
         "-i", str(tmp_path / "b.png"), "-n", "2", "-o", str(tmp_path / "out.png"), "--num-inference-steps", "2",
         "--no-progress"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [Image.open(tmp_path / f"out-{i}.png").size for i in range(2)] == [(80, 48), (80, 48)]


def test_the_playground_edits_a_chosen_image(dev_stack: Stack, tmp_path: Path, browser) -> None:  # noqa: F811
    page = Page(browser, tmp_path, "edit")
    browser.get(f"{dev_stack.gateway_url}/")
    page.wait(lambda: page["model"].text.startswith("model "), "the model card to load")
    (tmp_path / "in.png").write_bytes(png(80, 48))
    page["images"].send_keys(str(tmp_path / "in.png"))
    page.fill(prompt="make it green", size="auto", seed="3", steps="2")
    page["generate"].click()
    page.wait_for_result()
    page.shot("done")
    assert page["error"].text == ""
    assert page.result_size() == (80, 48)  # the input's size


def test_grpcurl_edits_an_input_image(dev_stack: Stack) -> None:
    import json
    import subprocess

    from tests.e2e.test_grpcurl import grpcurl_binary

    messages = [{"request": {"prompt": "make it green", "seed": 2, "knobs": {"num_inference_steps": 2}}},
                {"image": {"index": 0, "data": base64.b64encode(png(64, 48)).decode(), "last": True}}]
    done = subprocess.run(
        [grpcurl_binary(), "-plaintext", "-max-time", "300", "-d", "@", dev_stack.ar_address,
         "ardit.v1.ImageGenerator/EditImage"],
        input="\n".join(json.dumps(m) for m in messages), capture_output=True, text=True, timeout=320)
    assert done.returncode == 0, done.stderr
    events = [json.loads(chunk) for chunk in done.stdout.replace("}\n{", "}\x00{").split("\x00") if chunk.strip()]
    (image,) = [event["image"] for event in events if "image" in event]
    assert Image.open(io.BytesIO(base64.b64decode(image["data"]))).size == (64, 48)
    assert events[-1]["completed"]["width"] == 64
