"""response_format "url" over the real services, with the official openai client: the URL answers the image."""

from __future__ import annotations

import base64
import io

import httpx
from openai import OpenAI
from PIL import Image

KNOBS = {"num_inference_steps": 4}


def test_openai_client_gets_urls_of_the_same_images_as_b64(stack):
    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="not-checked", max_retries=0)
    by_url = client.images.generate(prompt="a lighthouse at dusk", size="256x128", n=2, response_format="url",
                                    extra_body={**KNOBS, "seed": 21})
    inline = client.images.generate(prompt="a lighthouse at dusk", size="256x128", n=2, response_format="b64_json",
                                    extra_body={**KNOBS, "seed": 21})
    assert [item.b64_json for item in by_url.data] == [None, None]
    for item, same in zip(by_url.data, inline.data, strict=True):
        assert item.url.startswith(f"{stack.gateway_url}/v1/images/files/")
        response = httpx.get(item.url, timeout=10)  # no key, no client: any browser or curl can
        assert response.status_code == 200 and response.headers["content-type"] == "image/png"
        assert "max-age=" in response.headers["cache-control"]
        assert response.content == base64.b64decode(same.b64_json)
        assert Image.open(io.BytesIO(response.content)).size == (256, 128)
    assert by_url.data[0].url != by_url.data[1].url


def test_jpeg_by_url(stack):
    body = httpx.post(f"{stack.gateway_url}/v1/images/generations", timeout=120, json={
        "prompt": "a fox", "response_format": "url", "output_format": "jpeg", "seed": 2, **KNOBS}).json()
    response = httpx.get(body["data"][0]["url"], timeout=10)
    assert response.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(response.content)).format == "JPEG"


def test_unknown_url_is_404_in_openai_shape(stack):
    response = httpx.get(f"{stack.gateway_url}/v1/images/files/{'x' * 43}.png", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "image_not_found"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
