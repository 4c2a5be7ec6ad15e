import io

import numpy as np
import pytest
from PIL import Image

from dit_service.imaging import encode_image


@pytest.fixture(scope="module")
def pixels():
    rng = np.random.default_rng(0)
    smooth = np.linspace(0, 255, 96 * 64 * 3).reshape(64, 96, 3)
    return np.clip(smooth + rng.normal(0, 20, smooth.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize(("fmt", "pil_name"), [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_formats_open_with_right_size_and_are_deterministic(pixels, fmt, pil_name):
    data = encode_image(pixels, fmt, None)
    image = Image.open(io.BytesIO(data))
    assert image.format == pil_name and image.size == (96, 64)
    assert encode_image(pixels, fmt, None) == data


def test_png_is_lossless(pixels):
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encode_image(pixels, "png", None)))), pixels)


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_more_compression_gives_smaller_files(pixels, fmt):
    assert len(encode_image(pixels, fmt, 80)) < len(encode_image(pixels, fmt, 10))


def test_rejects_unknown_format_and_bad_input(pixels):
    with pytest.raises(ValueError):
        encode_image(pixels, "gif", None)
    with pytest.raises(ValueError):
        encode_image(pixels.astype(np.float32), "png", None)
    with pytest.raises(ValueError):
        encode_image(pixels, "jpeg", 101)
