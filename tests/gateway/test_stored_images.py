"""Images answered by URL: the bounded store (memory and directory) and the gateway route that serves it.

The store's clock is injected, so an hour passes without sleeping. The gateway tests run the real app
against a small stand-in ImageGenerator that answers real PNG/JPEG/WebP bytes; tests/e2e/test_image_urls.py
does the same over the real services.
"""

from __future__ import annotations

import io
import time
from concurrent import futures
from email.utils import parsedate_to_datetime
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from PIL import Image

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.stored_images import DirectoryImageStore, ImageStore, MemoryImageStore, StoreFull, open_store
from protos import ar_pb2, ar_pb2_grpc, channels, common_pb2

HOUR = 3600.0
FORMATS = {common_pb2.OUTPUT_FORMAT_PNG: "PNG", common_pb2.OUTPUT_FORMAT_JPEG: "JPEG", common_pb2.OUTPUT_FORMAT_WEBP: "WEBP"}


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_store(kind: str, tmp_path: Path, clock: FakeClock, max_images: int = 3, max_bytes: int = 100) -> ImageStore:
    if kind == "memory":
        return MemoryImageStore(max_images, max_bytes, HOUR, clock=clock)
    return DirectoryImageStore(tmp_path / "images", max_images, max_bytes, HOUR, clock=clock)


@pytest.fixture(params=["memory", "directory"])
def kind(request) -> str:
    return request.param


# -- the store ----------------------------------------------------------------------------------


def test_an_image_is_kept_for_the_ttl_then_gone(kind, tmp_path):
    clock = FakeClock()
    store = make_store(kind, tmp_path, clock)
    [name] = store.put_all([b"pixels"], "png")
    image = store.get(name)
    assert image is not None and image.data == b"pixels" and image.content_type == "image/png"
    assert image.expires_at == pytest.approx(clock.now + HOUR)
    clock.now += HOUR - 1
    assert store.get(name) is not None
    clock.now += 1
    assert store.get(name) is None
    assert store.usage() == (0, 0)  # an expired image is dropped when asked for


def test_names_are_unguessable_and_carry_the_format(kind, tmp_path):
    store = make_store(kind, tmp_path, FakeClock(), max_images=3, max_bytes=1000)
    names = store.put_all([b"a", b"b"], "jpeg") + store.put_all([b"c"], "webp")
    assert len(set(names)) == 3
    assert all(len(name.split(".")[0]) == 43 for name in names)  # 256 random bits, url-safe base64
    assert [store.get(name).content_type for name in names] == ["image/jpeg", "image/jpeg", "image/webp"]
    for bad in ("../etc/passwd", names[0].split(".")[0], names[0] + ".png", "x" * 43 + ".gif", ""):
        assert store.get(bad) is None


def test_count_limit_drops_the_oldest(kind, tmp_path):
    clock = FakeClock()
    store = make_store(kind, tmp_path, clock, max_images=3, max_bytes=1000)
    names = []
    for i in range(5):
        names += store.put_all([bytes([i]) * 10], "png")
        clock.now += 1
    assert [store.get(name) is not None for name in names] == [False, False, True, True, True]
    assert store.usage() == (3, 30)


def test_byte_limit_drops_the_oldest(kind, tmp_path):
    clock = FakeClock()
    store = make_store(kind, tmp_path, clock, max_images=100, max_bytes=100)
    first = store.put_all([b"a" * 40], "png")[0]
    clock.now += 1
    second = store.put_all([b"b" * 40], "png")[0]
    clock.now += 1
    third = store.put_all([b"c" * 40], "png")[0]  # 120 bytes would not fit: the first goes
    assert store.get(first) is None and store.get(second) is not None and store.get(third) is not None
    assert store.usage() == (2, 80)


def test_expired_images_are_swept_when_a_new_one_comes(kind, tmp_path):
    clock = FakeClock()
    store = make_store(kind, tmp_path, clock, max_images=10, max_bytes=1000)
    store.put_all([b"x" * 10, b"y" * 10], "png")
    clock.now += HOUR
    store.put_all([b"z"], "png")
    assert store.usage() == (1, 1)
    clock.now += HOUR
    assert store.sweep() == 1 and store.usage() == (0, 0)


def test_a_response_that_cannot_fit_is_refused_and_evicts_nothing(kind, tmp_path):
    store = make_store(kind, tmp_path, FakeClock(), max_images=2, max_bytes=100)
    [kept] = store.put_all([b"k"], "png")
    with pytest.raises(StoreFull, match="b64_json"):
        store.put_all([b"a", b"b", b"c"], "png")
    with pytest.raises(StoreFull, match="101 bytes"):
        store.put_all([b"a" * 101], "png")
    assert store.get(kept) is not None


def test_one_response_never_evicts_its_own_images(kind, tmp_path):
    store = make_store(kind, tmp_path, FakeClock(), max_images=3, max_bytes=100)
    store.put_all([b"old" * 10], "png")
    names = store.put_all([b"a" * 30, b"b" * 30, b"c" * 30], "png")
    assert all(store.get(name) is not None for name in names)


def test_directory_store_is_shared_and_survives_a_restart(tmp_path):
    clock = FakeClock()
    one = DirectoryImageStore(tmp_path / "shared", 10, 1000, HOUR, clock=clock)
    other = DirectoryImageStore(tmp_path / "shared", 10, 1000, HOUR, clock=clock)  # a second gateway, or a restart
    [name] = one.put_all([b"made by one"], "png")
    assert other.get(name).data == b"made by one"
    clock.now += HOUR / 2
    assert other.get(name).expires_at == pytest.approx(clock.now + HOUR / 2)  # the expiry travels with the file
    clock.now += HOUR / 2
    assert other.get(name) is None and one.get(name) is None
    assert list((tmp_path / "shared").iterdir()) == []


def test_directory_store_applies_its_limits_at_start_and_clears_torn_writes(tmp_path):
    clock = FakeClock()
    directory = tmp_path / "images"
    big = DirectoryImageStore(directory, 10, 1000, HOUR, clock=clock)
    for i in range(5):
        big.put_all([bytes([i]) * 10], "png")
        clock.now += 1
    (directory / ".incoming-torn.png").write_bytes(b"half")  # a gateway died while writing
    (directory / "notes.txt").write_text("not ours")  # foreign files are left alone
    clock.now += HOUR  # the torn write is old now; the images are expired
    small = DirectoryImageStore(directory, 2, 1000, HOUR, clock=clock)
    assert small.usage() == (0, 0)
    assert sorted(path.name for path in directory.iterdir()) == ["notes.txt"]


def test_settings_pick_the_store(tmp_path):
    memory = open_store(GatewaySettings(image_store_max_images=7, image_store_max_bytes=99, image_url_ttl_s=60))
    assert isinstance(memory, MemoryImageStore)
    assert (memory.max_images, memory.max_bytes, memory.ttl_s) == (7, 99, 60)
    directory = open_store(GatewaySettings(image_store_dir=tmp_path / "d"))
    assert isinstance(directory, DirectoryImageStore) and (tmp_path / "d").is_dir()
    assert (directory.max_images, directory.max_bytes, directory.ttl_s) == (1000, 256 * 1024 * 1024, HOUR)


@pytest.mark.parametrize("bad", ["ftp://x", "example.com", "https://x/?a=1"])
def test_base_url_must_be_http(bad):
    with pytest.raises(ValueError, match="base_url"):
        GatewaySettings(base_url=bad)
    assert GatewaySettings(base_url="https://img.example.com/ardit/").base_url == "https://img.example.com/ardit"
    assert GatewaySettings(base_url="").base_url is None


# -- through the gateway ------------------------------------------------------------------------


class Painter(ar_pb2_grpc.ImageGeneratorServicer):
    """Answers n solid-colour images in the requested size and format."""

    def StreamImage(self, request, context):
        width, height = request.width or 64, request.height or 32
        fmt = FORMATS[request.output_format or common_pb2.OUTPUT_FORMAT_PNG]
        seed = request.seed if request.HasField("seed") else 5
        for index in range(request.n or 1):
            buffer = io.BytesIO()
            Image.new("RGB", (width, height), (index * 60 % 256, 90, 200)).save(buffer, format=fmt)
            yield ar_pb2.ImageEvent(image=common_pb2.GeneratedImage(
                index=index, seed=seed + index, format=request.output_format, data=buffer.getvalue(),
                width=width, height=height))
        yield ar_pb2.ImageEvent(completed=ar_pb2.GenerateImageResponse(
            request_id=request.request_id, model="painter", seed=seed, width=width, height=height))


@pytest.fixture(scope="module")
def painter() -> str:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channels.server_options())
    ar_pb2_grpc.add_ImageGeneratorServicer_to_server(Painter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def gateway(painter: str, clock: FakeClock, **settings) -> TestClient:
    app = create_app(GatewaySettings(ar_address=painter, dit_address=painter, **settings))
    app.state.image_store = open_store(app.state.settings, clock)  # the same store, on a clock the test turns
    return TestClient(app, raise_server_exceptions=False)


def openai_client(client: TestClient, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{client.base_url}/v1", api_key=api_key, max_retries=0, http_client=client)


@pytest.mark.parametrize("output_format", ["png", "jpeg", "webp"])
def test_openai_client_gets_urls_that_answer_the_image(painter, output_format):
    clock = FakeClock()
    with gateway(painter, clock) as client:
        result = openai_client(client).images.generate(
            prompt="a fox", size="128x64", n=2, response_format="url", output_format=output_format, extra_body={"seed": 3}
        )
        assert [item.b64_json for item in result.data] == [None, None]
        assert [item.model_extra["seed"] for item in result.data] == [3, 4]
        for index, item in enumerate(result.data):
            assert item.url.startswith(f"{client.base_url}/v1/images/files/")
            response = client.get(item.url)
            assert response.status_code == 200
            assert response.headers["content-type"] == f"image/{output_format}"
            image = Image.open(io.BytesIO(response.content))
            assert image.format == output_format.upper() and image.size == (128, 64)
            assert image.convert("RGB").getpixel((0, 0))[0] == pytest.approx(index * 60, abs=8)  # image i is image i


def test_url_answers_with_caching_headers_until_it_expires(painter, openai_error):
    clock = FakeClock()
    with gateway(painter, clock) as client:
        url = client.post("/v1/images/generations", json={"prompt": "a fox", "response_format": "url"}).json()["data"][0]["url"]
        clock.now += 600
        response = client.get(url)
        assert response.headers["cache-control"] == "private, max-age=3000, immutable"
        assert parsedate_to_datetime(response.headers["expires"]).timestamp() == int(clock.now + 3000)
        assert response.headers["x-content-type-options"] == "nosniff"
        again = client.get(url, headers={"If-None-Match": response.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        clock.now += 3000  # 60 minutes after it was made
        gone = client.get(url)
        error = openai_error(gone, 404, None)
        assert error["code"] == "image_not_found" and "expired" in error["message"]
        assert gone.headers["cache-control"] == "no-store"


@pytest.mark.parametrize("name", ["A" * 43 + ".png", "nothing-here", "..png", "..%2F..%2Fsettings.py"])
def test_unknown_image_is_404_in_openai_shape(painter, openai_error, name, tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "settings.py").write_text("secret")
    with gateway(painter, FakeClock(), image_store_dir=tmp_path / "images") as client:
        error = openai_error(client.get(f"/v1/images/files/{name}"), 404, None)
        assert error["type"] == "invalid_request_error"
        assert error["code"] == ("not_found" if "%2F" in name else "image_not_found")  # a "/" leaves the route


def test_base_url_setting_names_the_public_address(painter):
    with gateway(painter, FakeClock(), base_url="https://images.example.com/ardit/") as client:
        url = client.post("/v1/images/generations", json={"prompt": "a fox", "response_format": "url"}).json()["data"][0]["url"]
        assert url.startswith("https://images.example.com/ardit/v1/images/files/")
        assert client.get("/v1/images/files/" + url.rsplit("/", 1)[1]).status_code == 200


def test_urls_need_no_key_but_generation_does(painter):
    with gateway(painter, FakeClock(), api_keys="sk-one") as client:
        assert client.post("/v1/images/generations", json={"prompt": "a fox"}).status_code == 401
        result = openai_client(client, api_key="sk-one").images.generate(prompt="a fox", response_format="url")
        assert client.get(result.data[0].url).status_code == 200  # no Authorization header: an <img> sends none


def test_a_response_over_the_store_limits_is_a_400(painter, openai_error):
    with gateway(painter, FakeClock(), image_store_max_images=2) as client:
        response = client.post("/v1/images/generations", json={"prompt": "a fox", "n": 3, "response_format": "url"})
        error = openai_error(response, 400, "response_format")
        assert "b64_json" in error["message"]


def test_the_store_stays_within_its_limits_under_many_requests(painter):
    clock = FakeClock()
    with gateway(painter, clock, image_store_max_images=4) as client:
        urls = []
        for _ in range(6):
            urls.append(client.post("/v1/images/generations", json={"prompt": "a fox", "response_format": "url"}).json())
            clock.now += 1
        assert client.app.state.image_store.usage()[0] == 4
        statuses = [client.get(body["data"][0]["url"]).status_code for body in urls]
        assert statuses == [404, 404, 200, 200, 200, 200]


def test_gateways_sharing_a_directory_serve_each_others_images(painter, tmp_path):
    clock = FakeClock()
    with gateway(painter, clock, image_store_dir=tmp_path) as one, gateway(painter, clock, image_store_dir=tmp_path) as other:
        url = one.post("/v1/images/generations", json={"prompt": "a fox", "response_format": "url"}).json()["data"][0]["url"]
        response = other.get(url)
        assert response.status_code == 200 and response.headers["content-type"] == "image/png"


def test_an_idle_gateway_sweeps_expired_images(painter, tmp_path):
    """No request needed: the gateway's sweeper drops what expired (ttl 0.2 s: it sweeps every 0.1 s)."""
    clock = FakeClock()
    with gateway(painter, clock, image_store_dir=tmp_path, image_url_ttl_s=0.2) as client:
        client.post("/v1/images/generations", json={"prompt": "a fox", "n": 2, "response_format": "url"})
        assert len(list(tmp_path.iterdir())) == 2
        clock.now += 0.2  # expired on the store's clock; the sweeper runs on real time
        deadline = time.monotonic() + 30
        while list(tmp_path.iterdir()):
            assert time.monotonic() < deadline, "expired images were not swept"
            time.sleep(0.05)
