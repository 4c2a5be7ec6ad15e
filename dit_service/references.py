"""The reference images of an edit, from the file bytes a Render carries to the [-1, 1] pixels the VAE encodes.

Preprocessing as the released Dev code does it (bytedance/mammothmoda main, ``mamoda2/mammothmoda2/``; no code copied):
- ``extract_ref_image`` (``utils/vision_processor.py`` 504-522) takes each input image through ``fetch_image`` with
  ``image_patch_size=8``, so factor 16 (``SPATIAL_MERGE_SIZE`` 2), ``min_pixels`` 4 * 16^2 (the element has none)
  and ``max_pixels`` 1024^2: ``to_rgb`` (RGBA pasted on white through its alpha, any other mode ``convert("RGB")``),
  then ``smart_resize`` (``vision_processor.py`` 55-81: round each side to the factor, at least the factor; above
  max_pixels scale by sqrt(h*w / max) and floor, below min_pixels scale up and ceil; an aspect ratio over 200 is an
  error) and ``Image.resize`` without ``resample``, which is BICUBIC for RGB.
- ``VAEProcessor().preprocess`` (``utils/t2i_utils.py`` 38-53, ``utils/vae_processor.py`` 82-146, 227-274):
  ``Mammothmoda2VAEImageProcessor(vae_scale_factor=16, max_side_length=2048, max_pixels=1024^2, resample="lanczos")``:
  ratio = min(sqrt(max_pixels / (h*w)), 2048 / max(h, w), 1.0), new side = int(side * ratio) // 16 * 16, Lanczos
  resize (Pillow returns a copy when the size is unchanged, the usual case after fetch_image), /255, then 2x - 1.

The output image takes the last reference's preprocessed size (``t2i_utils.py`` 337-345).

What ardit adds: the bytes must be a PNG, JPEG or WebP file whose header declares a size of at most
``MAX_SOURCE_PIXELS`` (checked before the pixels are decoded), and anything that fails to decode is a
``RequestRejected`` naming the reference, never an internal error. EXIF orientation is not applied (neither is it
in the released ``fetch_image``).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from protos.status import RequestRejected
from servicekit.released_images import reference_fetch_size, to_rgb, vae_size

#: ardit's bound on a reference file's declared size, checked before decoding (a small file may declare a huge
#: image): 8192 x 8192.
MAX_SOURCE_PIXELS = 8192 * 8192
FORMATS = ("PNG", "JPEG", "WEBP")


def preprocess_image(image: Image.Image) -> torch.Tensor:
    """A decoded image -> float32 [3, H, W] in [-1, 1], as ``extract_ref_image`` then ``VAEProcessor().preprocess``
    leave it (H, W multiples of 16)."""
    rgb = to_rgb(image)
    width, height = rgb.size
    new_h, new_w = reference_fetch_size(height, width)
    rgb = rgb.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    vae_h, vae_w = vae_size(new_h, new_w)
    if vae_h <= 0 or vae_w <= 0:  # cannot happen after reference_fetch_size; kept as a check
        raise ValueError(f"the VAE preprocessing leaves a {vae_w}x{vae_h} image")
    rgb = rgb.resize((vae_w, vae_h), resample=Image.Resampling.LANCZOS)
    array = np.asarray(rgb, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous() * 2.0 - 1.0


def decode_reference(data: bytes, index: int) -> Image.Image:
    """A reference file's bytes -> its decoded image; RequestRejected (param ``reference``) naming reference
    ``index`` and what is wrong: not an image, a format other than PNG/JPEG/WebP, an empty or oversized image, a
    truncated or corrupt file."""

    def reject(why: str) -> RequestRejected:
        return RequestRejected(f"reference image {index}: {why}", param="reference")

    if not data:
        raise reject("no bytes were sent")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise reject(f"format {image.format} is not accepted; send PNG, JPEG or WebP")
            width, height = image.size
            if width <= 0 or height <= 0:
                raise reject(f"the image is empty ({width}x{height})")
            if width * height > MAX_SOURCE_PIXELS:
                raise reject(f"{width}x{height} is more than the {MAX_SOURCE_PIXELS} pixels accepted")
            image.load()
    except RequestRejected:
        raise
    except UnidentifiedImageError:
        raise reject("the bytes are not a PNG, JPEG or WebP image") from None
    except Exception as exc:  # any decoder failure is the file's (OSError, SyntaxError, struct errors, bombs, ...)
        raise reject(f"the file does not decode ({type(exc).__name__}: {exc}); it may be truncated or corrupt") from None
    return image


def load_reference(data: bytes, index: int) -> torch.Tensor:
    """Bytes of reference ``index`` -> float32 [3, H, W] in [-1, 1] (``decode_reference`` then ``preprocess_image``)."""
    image = decode_reference(data, index)
    try:
        return preprocess_image(image)
    except ValueError as exc:  # smart_resize's aspect-ratio limit
        raise RequestRejected(f"reference image {index}: {exc}", param="reference") from None
    except Exception as exc:  # a palette or frame that fails only on conversion
        raise RequestRejected(
            f"reference image {index}: the file does not decode ({type(exc).__name__}: {exc})", param="reference"
        ) from None
