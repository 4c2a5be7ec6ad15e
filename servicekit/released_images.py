"""How the released MammothModa2-Dev code resizes an input image, kept in one place because both model services
apply it: ar_service tokenizes the input with MammothTok and announces the edit's output size, dit_service encodes the
same input as a reference latent of that size. Torch-free (PIL only).

Facts from bytedance/mammothmoda main, ``mamoda2/mammothmoda2/utils/`` (no code copied):
- ``vision_processor.py`` 55-81 ``smart_resize``: an aspect ratio over 200 is an error; each side is rounded (Python's
  ``round``) to a multiple of ``factor``, at least ``factor``; above ``max_pixels`` both are scaled by
  sqrt(h * w / max_pixels) and floored to the factor, below ``min_pixels`` scaled up and ceiled. The limits default to
  4 and 16384 patches of factor x factor (``IMAGE_MIN_TOKEN_NUM``, ``IMAGE_MAX_TOKEN_NUM``).
- ``vision_processor.py`` 84-91 ``to_rgb``: RGBA is pasted on white through its alpha; any other mode converted.
- ``vision_processor.py`` 504-522 ``extract_ref_image``: a reference is fetched with factor 16 and at most 1024^2
  pixels; ``vae_processor.py`` 82-146: then ``ratio = min(sqrt(max_pixels / (h * w)), 2048 / max(h, w), 1.0)`` and
  each side ``int(side * ratio) // 16 * 16`` (never enlarged). The edit's output takes that size (``t2i_utils.py``
  337-345).
"""

from __future__ import annotations

import math

from PIL import Image

MIN_TOKENS = 4
MAX_TOKENS = 16384
MAX_RATIO = 200
#: ``extract_ref_image``: the factor and the pixel bound of a reference.
REFERENCE_FACTOR = 16
REFERENCE_MIN_PIXELS = MIN_TOKENS * REFERENCE_FACTOR**2
REFERENCE_MAX_PIXELS = 1024 * 1024
#: ``Mammothmoda2VAEImageProcessor`` as ``VAEProcessor`` builds it (``t2i_utils.py`` 39-45).
VAE_SCALE_FACTOR = 16
VAE_MAX_SIDE = 2048
VAE_MAX_PIXELS = 1024 * 1024


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy: RGBA composited onto white through its alpha channel; any other mode converted."""
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int]:
    """(height, width) after the released rule: multiples of ``factor``, area within [min_pixels, max_pixels]
    (defaults 4 and 16384 patches), aspect ratio kept as closely as that allows; ValueError past the ratio limit."""
    max_pixels = MAX_TOKENS * factor**2 if max_pixels is None else max_pixels
    min_pixels = MIN_TOKENS * factor**2 if min_pixels is None else min_pixels
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width} (HxW)")
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels {max_pixels} is below min_pixels {min_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio must be at most {MAX_RATIO}, got {max(height, width) / min(height, width):g}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar < factor or w_bar < factor:
        raise ValueError(f"{height}x{width} (HxW) cannot fit max_pixels {max_pixels} with sides of at least {factor}")
    return h_bar, w_bar


def reference_fetch_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) a reference is first resized to (BICUBIC): ``extract_ref_image``'s ``smart_resize``."""
    return smart_resize(height, width, REFERENCE_FACTOR, REFERENCE_MIN_PIXELS, REFERENCE_MAX_PIXELS)


def vae_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) after ``Mammothmoda2VAEImageProcessor.get_new_height_width``: never upscaled, at most 1024^2
    pixels and 2048 a side, each side floored to a multiple of 16."""
    side_ratio = VAE_MAX_SIDE / (height if height > width else width)
    pixels_ratio = (VAE_MAX_PIXELS / (height * width)) ** 0.5
    ratio = min(pixels_ratio, side_ratio, 1.0)
    return (int(height * ratio) // VAE_SCALE_FACTOR * VAE_SCALE_FACTOR,
            int(width * ratio) // VAE_SCALE_FACTOR * VAE_SCALE_FACTOR)


def reference_size(height: int, width: int) -> tuple[int, int]:
    """(height, width) of a reference of ``height`` x ``width`` pixels as the DiT encodes it, which is also the size
    of an edit whose last input image it is."""
    return vae_size(*reference_fetch_size(height, width))
