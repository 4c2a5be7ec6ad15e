"""POST /v1/images/edits against a stand-in ImageGenerator that records what EditImage receives: the multipart form
as OpenAI defines it, the input images checked with PIL before anything reaches the AR (each problem a 400 naming
it), the limits, the EditImage stream's pieces, the JSON and SSE answers and the openai client."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import grpc
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from dit_service.png import SIGNATURE, chunk
from gateway.app import create_app
from gateway.edits import CHUNK_BYTES, parse_multipart
from gateway.settings import GatewaySettings
from protos import ar_pb2, ar_pb2_grpc, common_pb2
from protos.status import abort
from protos.values import knobs_from_proto
from tests.gateway.test_gateway_fake_backend import start_fake_backend

URL = "/v1/images/edits"


class FakeEditor(ar_pb2_grpc.ImageGeneratorServicer):
    def __init__(self):
        self.calls: list[tuple[ar_pb2.GenerateImageRequest, list[bytes], list[int]]] = []

    def EditImage(self, request_iterator, context):
        request, images, pieces = None, [], []
        for message in request_iterator:
            if message.WhichOneof("input") == "request":
                request = message.request
            else:
                chunk = message.image
                if chunk.index == len(images):
                    images.append(b"")
                images[chunk.index] += chunk.data
                pieces.append(len(chunk.data))
        self.calls.append((request, images, pieces))
        if request.prompt == "preview":
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  "this model does not edit images: it is a MammothModa2 preview checkpoint", "model")
        width, height = request.width or Image.open(io.BytesIO(images[-1])).width, request.height or 48
        yield ar_pb2.ImageEvent(started=ar_pb2.StreamStarted(request_id=request.request_id, model="fake", seed=5,
                                                             width=width, height=height, n=request.n or 1))
        if request.partial_images:
            yield ar_pb2.ImageEvent(preview=common_pb2.PreviewImage(index=0, partial_index=0, step=1, total=2,
                                                                    data=b"preview", width=width, height=height))
        for index in range(request.n or 1):
            yield ar_pb2.ImageEvent(image=common_pb2.GeneratedImage(index=index, seed=5 + index, data=b"edited",
                                                                    width=width, height=height))
        yield ar_pb2.ImageEvent(completed=ar_pb2.GenerateImageResponse(request_id=request.request_id, model="fake",
                                                                       seed=5, width=width, height=height))


@pytest.fixture(scope="module")
def backend():
    editor = FakeEditor()
    server, address, _ = start_fake_backend(editor)
    yield address, editor
    server.stop(grace=None)


@pytest.fixture(scope="module")
def client(backend):
    address, _ = backend
    settings = GatewaySettings(ar_address=address, dit_address=address, request_timeout_s=10.0,
                               edit_max_image_bytes=24_000_000, edit_max_total_bytes=30_000_000,
                               edit_max_image_pixels=10_000_000)
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def png(width=64, height=48, mode="RGB", color=(200, 30, 30), **save) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color).save(buffer, format="PNG", **save)
    return buffer.getvalue()


def raw_png(width: int, height: int, depth: int = 8, color_type: int = 2, data: bytes = b"") -> bytes:
    """A PNG written by hand: any IHDR (0x0, huge, 16-bit), any IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0)
    return SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(data)) + chunk(b"IEND", b"")


def post(client, images, **fields):
    files = [("image[]" if len(images) > 1 else "image", (f"in{i}.png", data, "image/png"))
             for i, data in enumerate(images)]
    form = {key: value if isinstance(value, str) else json.dumps(value) for key, value in fields.items()}
    return client.post(URL, data=form, files=files)


def test_one_image_edit_goes_to_edit_image_with_its_fields(client, backend):
    _, editor = backend
    image = png()
    response = post(client, [image], prompt="make it blue", n=2, seed=9, output_format="jpeg", output_compression=70,
                    num_inference_steps=4, cfg_range=[0.25, 0.5], input_fidelity="high", user="alice")
    assert response.status_code == 200, response.text
    body = response.json()
    assert [base64.b64decode(item["b64_json"]) for item in body["data"]] == [b"edited", b"edited"]
    assert body["size"] == "64x48" and body["ignored_fields"] == ["input_fidelity"]
    assert response.headers["x-ardit-ignored-fields"] == "input_fidelity"
    request, images, _ = editor.calls[-1]
    assert images == [image]
    assert (request.prompt, request.n, request.seed, request.width, request.height) == ("make it blue", 2, 9, 0, 0)
    assert request.output_format == common_pb2.OUTPUT_FORMAT_JPEG and request.output_compression == 70
    assert knobs_from_proto(request.knobs) == {"num_inference_steps": 4, "cfg_range": [0.25, 0.5]}


def test_several_images_in_order_and_large_files_in_pieces(client, backend):
    _, editor = backend
    noise = Image.frombytes("RGB", (1500, 1500), bytes(range(256)) * (1500 * 1500 * 3 // 256) + bytes(1500 * 1500 * 3 % 256))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG", compress_level=0)
    big, small = buffer.getvalue(), png(32, 32)
    assert len(big) > 2 * CHUNK_BYTES
    response = post(client, [small, big], prompt="combine", size="auto")
    assert response.status_code == 200, response.text
    _, images, pieces = editor.calls[-1]
    assert images == [small, big] and max(pieces) <= CHUNK_BYTES and len(pieces) >= 3


def test_openai_client_edit_one_and_several_and_stream(client, backend):
    from openai import OpenAI

    _, editor = backend
    api = OpenAI(base_url=f"{client.base_url}/v1", api_key="x", max_retries=0, http_client=client)
    one = api.images.edit(image=("a.png", png(), "image/png"), prompt="add a hat", extra_body={"seed": 3})
    assert base64.b64decode(one.data[0].b64_json) == b"edited" and editor.calls[-1][0].seed == 3
    several = api.images.edit(image=[("a.png", png(), "image/png"), ("b.png", png(40, 40), "image/png")],
                              prompt="merge", n=1)
    assert len(several.data) == 1 and len(editor.calls[-1][1]) == 2
    events = list(api.images.edit(image=("a.png", png(), "image/png"), prompt="stream it", stream=True,
                                  partial_images=1))
    assert [event.type for event in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert base64.b64decode(events[-1].b64_json) == b"edited" and events[-1].size == "64x48"


@pytest.mark.parametrize(("data", "words"), [
    (b"", "empty"),
    (b"this is not an image at all", "not an image"),
    (png()[:-40], "truncated"),
    (raw_png(0, 0), "no pixels"),
    (raw_png(20_000, 20_000), "decompression bomb"),
    (png(mode="RGBA", color=(1, 2, 3, 128)), "alpha channel"),
    (png(mode="LA", color=(1, 128)), "alpha channel"),
    (raw_png(4, 4, depth=16, color_type=2, data=bytes((1 + 4 * 6) * 4)), "16 bits"),
    (png(mode="I;16", color=300), "16 bits"),
])
def test_bad_images_are_400s_naming_the_problem_before_the_ar(client, backend, data, words):
    _, editor = backend
    before = len(editor.calls)
    response = post(client, [png(), data], prompt="edit")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and "input image 1" in error["message"] and error["param"] == "image"
    assert len(editor.calls) == before


def test_cmyk_jpeg_is_refused(client, backend):
    buffer = io.BytesIO()
    Image.new("CMYK", (16, 16), (0, 50, 100, 0)).save(buffer, format="JPEG")
    response = post(client, [buffer.getvalue()], prompt="edit")
    assert response.status_code == 400 and "CMYK" in response.json()["error"]["message"]


def test_limits_bytes_count_and_body(client, backend):
    _, editor = backend
    before = len(editor.calls)
    over = png() + bytes(24_000_001 - len(png()))  # a PNG padded past edit_max_image_bytes
    response = post(client, [over], prompt="edit")
    assert response.status_code == 400 and "at most 24000000" in response.json()["error"]["message"]
    response = post(client, [png()] * 6, prompt="edit")
    assert response.status_code == 400 and "at most 5 input images" in response.json()["error"]["message"]
    too_big = client.post(URL, content=b"x" * 32_000_000, headers={"content-type": "multipart/form-data; boundary=b"})
    assert too_big.status_code == 413
    assert len(editor.calls) == before


@pytest.mark.parametrize(("fields", "files", "status", "words"), [
    ({"prompt": "x"}, [("mask", ("m.png", png(), "image/png"))], 400, "mask"),
    ({}, [("prompt", (None, "x"))], 400, "missing required parameter 'image'"),
    ({"prompt": "x", "n": "two"}, None, 400, "'n' must be an integer"),
    ({"prompt": "x", "stream": "maybe"}, None, 400, "true or false"),
    ({"prompt": "x", "background": "transparent"}, None, 400, "transparent"),
    ({"prompt": "x", "input_fidelity": "ultra"}, None, 400, "input_fidelity"),
    ({}, None, 400, "prompt"),
])
def test_form_errors(client, fields, files, status, words):
    files = [("image", ("a.png", png(), "image/png"))] if files is None else files
    if any(name == "mask" for name, _ in files):
        files = [("image", ("a.png", png(), "image/png")), *files]
    response = client.post(URL, data=fields, files=files)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


def test_json_body_is_refused_naming_multipart(client):
    response = client.post(URL, json={"prompt": "x", "image": "abc"})
    assert response.status_code == 400 and "multipart/form-data" in response.json()["error"]["message"]


def test_a_model_that_cannot_edit_answers_its_reason(client):
    response = post(client, [png()], prompt="preview")
    assert response.status_code == 400
    assert "does not edit images" in response.json()["error"]["message"]


def test_multipart_parser_reads_quoted_names_and_binary():
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a;b.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n\r\n--Xy\x00\xff\r\n--XyZ--\r\n")
    parts = parse_multipart(body, 'multipart/form-data; boundary="XyZ"')
    assert [(p.name, p.data, p.filename) for p in parts] == [("prompt", b"hi", None), ("image", b"\r\n--Xy\x00\xff", "a;b.png")]


@pytest.mark.parametrize(("body", "content_type", "says"), [
    (b"--XyZ\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhi\r\n--XyZ\r\nContent-Disposition: form-data; "
     b"name=\"image\"; filename=\"a.png\"\r\n\r\n\x89PNG", "multipart/form-data; boundary=XyZ", "truncated"),
    (b"--XyZ\r\nContent-Disposition: form-data; filename=\"a.png\"\r\n\r\nabc\r\n--XyZ--\r\n",
     "multipart/form-data; boundary=XyZ", "name not found"),
    (b"prompt=hi", "application/x-www-form-urlencoded", "multipart/form-data"),
    (b"--XyZ--\r\n", "multipart/form-data", "without a boundary"),
])
def test_a_malformed_form_is_a_400_saying_why(client, body, content_type, says):
    response = client.post(URL, content=body, headers={"content-type": content_type})
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]


def test_metrics_count_the_edits_route(client):
    post(client, [png()], prompt="count me")
    text = client.get("/metrics").text
    assert 'route="/v1/images/edits"' in text
