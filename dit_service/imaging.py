"""Pixels -> image file bytes (PNG with ``dit_service.png``, JPEG and WebP with Pillow); deterministic for the same
pixels and settings."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from dit_service.png import encode_png
from protos.formats import FORMATS

# Quality when the caller gives no output_compression: 90 keeps JPEG/WebP artefacts hard to see at a fraction of
# PNG's size (Pillow's own defaults are 75 and 80).
DEFAULT_QUALITY = 90
# zlib level of an answered PNG (dit_service's png_compress_level setting). The fastest level: with Pillow's encoder on
# the H100 host a smooth 1024x1024 picture took 176 ms at level 1 and 557 ms at level 6, for a file 17% larger (1,769
# KiB against 1,510; bench/results/h100/png/png_levels.json); the encode sits on every image's critical path, the
# bytes only on the wire. dit_service.png deflates on several cores (bench.png_levels compares the two encoders).
PNG_COMPRESS_LEVEL = 1
# Partial images are looked at once and replaced: zlib's fastest level whatever the setting (a 1024x1024 preview at
# level 6 took 277 ms on the H200 host, 7% of the render it previews; bench/results/h200/preview_cost.json).
PREVIEW_PNG_COMPRESS_LEVEL = 1
# Fixed WebP effort (0 fast .. 6 slow); part of what makes the bytes reproducible.
WEBP_METHOD = 4


def quality_for(compression: int | None) -> int:
    """OpenAI's output_compression (0-100, higher = smaller file) -> encoder quality (1-100)."""
    if compression is None:
        return DEFAULT_QUALITY
    if not 0 <= compression <= 100:
        raise ValueError(f"compression must be between 0 and 100; got {compression}")
    return max(1, 100 - compression)


def enlarge(pixels: np.ndarray, factor: int) -> np.ndarray:
    """uint8 [H, W, 3] pixels enlarged a whole ``factor`` times along each side (Lanczos; 1 returns them as they are).

    A checkpoint that allows it (ServingDefaults.max_upscale) answers sizes above what it renders this way."""
    if factor < 1:
        raise ValueError(f"factor must be a positive whole number; got {factor}")
    if factor == 1:
        return pixels
    height, width = pixels.shape[:2]
    image = Image.fromarray(np.ascontiguousarray(pixels)).resize((width * factor, height * factor), Image.Resampling.LANCZOS)
    return np.asarray(image)


def encode_image(pixels: np.ndarray, fmt: str, compression: int | None = None, png_level: int = PNG_COMPRESS_LEVEL) -> bytes:
    """Encodes uint8 [H, W, 3] pixels; compression is ignored for PNG (lossless), whose zlib level is png_level."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels must be uint8 [H, W, 3]; got {pixels.dtype} {pixels.shape}")
    if fmt == "png":
        return encode_png(pixels, png_level)
    image = Image.fromarray(np.ascontiguousarray(pixels))
    out = io.BytesIO()
    if fmt == "jpeg":
        image.save(out, format="JPEG", quality=quality_for(compression), optimize=False)
    elif fmt == "webp":
        image.save(out, format="WEBP", quality=quality_for(compression), method=WEBP_METHOD)
    else:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return out.getvalue()
