"""dit_service.png: the answered PNG, deflated in segments on several threads, is one valid file whose pixels are the
render's, whose bytes do not depend on the threads, and which compresses about as well as Pillow's."""

import io
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from bench.png_levels import pictures
from dit_service import png


def decoded(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image.verify()  # chunk CRCs and structure
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image)


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == png.SIGNATURE
    out, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length : at + 12 + length])[0] == zlib.crc32(kind + body)
        out.append((kind, body))
        at += 12 + length
    return out


@pytest.fixture(scope="module")
def smooth():
    return pictures(256)["smooth"]


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 96), (700, 300), (1024, 1024)])
@pytest.mark.parametrize("level", [0, 1, 6, 9])
def test_pixels_come_back_exactly_across_segment_boundaries(shape, level):
    """(700, 300) and (1024, 1024) span several 256 KiB segments, whose boundaries fall mid-row."""
    rng = np.random.default_rng(shape[0] * 31 + level)
    pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    pixels[: shape[0] // 2] //= 16  # half of it compressible, so segments refer back across their boundaries
    data = png.encode_png(pixels, level)
    assert np.array_equal(decoded(data), pixels)
    kinds = [kind for kind, _ in chunks(data)]
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]
    stream = chunks(data)[1][1]
    assert len(zlib.decompress(stream)) == shape[0] * (1 + shape[1] * 3)  # one zlib stream, Adler-32 checked


def test_bytes_do_not_depend_on_how_many_threads_deflate(smooth):
    big = np.tile(smooth, (4, 4, 1))  # 1024x1024: 12 segments
    with ThreadPoolExecutor(1) as one, ThreadPoolExecutor(5) as five:
        assert png.encode_png(big, 1, pool=one) == png.encode_png(big, 1, pool=five) == png.encode_png(big, 1)


def test_a_smooth_picture_compresses_about_as_well_as_pillow_and_higher_levels_are_smaller(smooth):
    out = io.BytesIO()
    Image.fromarray(smooth).save(out, format="PNG", compress_level=1)
    ours = png.encode_png(smooth, 1)
    assert len(ours) < 1.1 * len(out.getvalue()) and len(ours) < 0.75 * smooth.nbytes
    assert len(png.encode_png(smooth, 9)) < len(ours) < len(png.encode_png(smooth, 0))


@pytest.mark.parametrize("level", [0, 1, 6, 9])
def test_the_zlib_header_is_valid_for_its_level(level):
    header = png.zlib_header(level)
    assert header[0] == 0x78 and (header[0] * 256 + header[1]) % 31 == 0 and not header[1] & 0x20  # no dictionary


def test_bad_pixels_or_level_are_refused():
    for bad in (np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8), np.zeros((0, 4, 3), np.uint8),
                np.zeros((4, 4, 4), np.uint8)):
        with pytest.raises(ValueError, match="uint8"):
            png.encode_png(bad, 1)
    with pytest.raises(ValueError, match="level"):
        png.encode_png(np.zeros((4, 4, 3), np.uint8), 10)
