"""OpenAI's ``POST /v1/images/edits``: the multipart request, its input images checked with PIL, and the gRPC call.

Sources, read for this list: OpenAI's API reference, "Create image edit" (``/v1/images/edits``, multipart/form-data),
and openai-python's ``openai/types/image_edit_params.py`` (generated from OpenAI's OpenAPI spec). The form's fields:

- ``image`` (one file) or ``image[]`` (several, in order; openai-python sends a list that way): PNG, JPEG or WebP.
  At most ``MAX_INPUT_IMAGES`` (OpenAI takes 16 for its GPT image models; the MammothModa2-Dev DiT tells its
  references apart by ``image_index_embedding``, which has 5 rows).
- ``prompt`` (the instruction), ``model``, ``n``, ``size`` (``auto``: the output takes the last input image's size),
  ``quality``, ``response_format``, ``output_format``, ``output_compression``, ``background``, ``user``,
  ``safety_identifier``, ``stream``, ``partial_images`` and the knobs: as ``/v1/images/generations`` takes them
  (gateway/protocol.py), fields without effect named in ``ignored_fields`` and ``X-Ardit-Ignored-Fields``.
- ``input_fidelity`` (``high`` / ``low``): accepted, without effect (the models have no such setting).
- ``mask`` and ``markup``: refused (400) naming why: inpainting through a mask is not implemented (the released Dev
  model edits the whole picture from the instruction).

Multipart values are text: a field OpenAI types as an integer or a boolean is read as one (``n=2``,
``stream=true``), a knob's value as JSON when it reads as JSON other than a string (a number, a boolean, a list such
as ``cfg_range=[0.2, 0.8]``), else as the text.

Every input image is opened with PIL here, before anything reaches ar_service, and each problem is a 400 in OpenAI's
error shape naming the image and what is wrong: empty, over the byte limit, not a PNG / JPEG / WebP image, no pixels,
over the pixel limit (a decompression bomb), CMYK or another colour mode the models do not take, 16 bits per
channel, an alpha channel (transparency), truncated or corrupt data.
"""

from __future__ import annotations

import io
import json
import re
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from python_multipart import create_form_parser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import Field as FormField
from python_multipart.multipart import File as FormFile

from gateway.errors import APIError
from gateway.protocol import ImageGenerationRequest
from protos import ar_pb2, common_pb2

ROUTE = "/v1/images/edits"
#: Input images of one edit; see the module doc.
MAX_INPUT_IMAGES = 5
#: Bytes of an image file per EditImageInput message: under gRPC's 4 MiB default with the envelope.
CHUNK_BYTES = 3 * 1024 * 1024
#: Form room beside the images: the text fields and the multipart framing.
FORM_SLACK_BYTES = 1_048_576
IMAGE_FIELDS = ("image", "image[]")
#: File fields OpenAI defines that ardit refuses, and why.
REFUSED_FILES = {
    "mask": "'mask' is not supported: inpainting through a mask is not implemented here (the model edits the whole "
            "picture from the instruction); send the image and the prompt without a mask",
    "markup": "'markup' is not supported: markup edits are not implemented here; send the image and the prompt alone",
}
#: Image formats accepted (PIL's names) and the colour modes the models take.
FORMATS = ("PNG", "JPEG", "WEBP")
MODES = ("RGB", "L", "P", "1")
_KEY = re.compile(r"^([A-Za-z0-9_]+)((?:\[[A-Za-z0-9_]*\])*)$")


class ImageEditRequest(ImageGenerationRequest):
    """The text fields of ``POST /v1/images/edits``: generations' fields plus ``input_fidelity``."""

    input_fidelity: Literal["high", "low"] | None = Field(
        None, description="Without effect: the models have no input-fidelity setting."
    )

    def ignored_fields(self) -> list[str]:
        ignored = set(super().ignored_fields())
        if self.input_fidelity is not None:
            ignored.add("input_fidelity")
        return sorted(ignored)


@dataclass(frozen=True)
class Part:
    name: str
    data: bytes
    filename: str | None
    content_type: str | None


@dataclass(frozen=True)
class EditLimits:
    max_image_bytes: int
    max_total_bytes: int
    max_image_pixels: int


# -- multipart ------------------------------------------------------------------------------------


def _boundary(content_type: str) -> bytes:
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise APIError(400, f"{ROUTE} takes multipart/form-data (the image files and the fields); got "
                       f"{kind.strip() or 'no Content-Type'!r}", code="invalid_content_type")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary" and value:
            return value.strip().strip('"').encode("latin-1")
    raise APIError(400, "multipart/form-data without a boundary", code="invalid_multipart")


def parse_multipart(body: bytes, content_type: str) -> list[Part]:
    """The parts of a multipart/form-data body (RFC 7578), in order, parsed by python-multipart (Starlette's form
    parser); every part stays in memory (the body already is, within the route's limit)."""
    _boundary(content_type)  # a clear 400 for a body that is not multipart/form-data
    parts: list[Part] = []

    def named(raw: bytes | None) -> str:
        if not raw:
            raise APIError(400, "malformed multipart body: a part without a name", code="invalid_multipart")
        return raw.decode("utf-8", "replace")

    def on_field(field: FormField) -> None:
        parts.append(Part(named(field.field_name), field.value or b"", None, None))

    def on_file(file: FormFile) -> None:
        file.file_object.seek(0)
        name = None if file.file_name is None else file.file_name.decode("utf-8", "replace")
        parts.append(Part(named(file.field_name), file.file_object.read(), name, file.content_type))

    headers = {"Content-Type": content_type.encode("latin-1"), "Content-Length": str(len(body)).encode()}
    config = {"MAX_MEMORY_FILE_SIZE": len(body) + 1, "UPLOAD_KEEP_FILENAME": False}
    try:
        parser = create_form_parser(headers, on_field, on_file, config=config)
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:
        raise APIError(400, f"malformed multipart body: {exc}", code="invalid_multipart") from None
    if not body.rstrip().endswith(b"--"):  # python-multipart takes a body cut short as ending there
        raise APIError(400, "malformed multipart body: the last part never ends (truncated upload?)",
                       code="invalid_multipart")
    return parts


def _insert(target: dict[str, Any], name: str, value: Any) -> None:
    """``svg[reasoning][effort]`` -> target["svg"]["reasoning"]["effort"]; a repeated plain field is refused."""
    match = _KEY.match(name)
    keys = [name] if match is None else [match.group(1), *re.findall(r"\[([A-Za-z0-9_]*)\]", match.group(2))]
    node = target
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise APIError(400, f"form field {name!r} conflicts with another field of that name", keys[0],
                           "invalid_value")
    if keys[-1] in node:
        raise APIError(400, f"form field {name!r} is given twice", keys[0], "invalid_value")
    node[keys[-1]] = value


def _typed(name: str, text: str) -> Any:
    """A form value as the request model types it: ints and booleans of OpenAI's fields from their text, knobs as
    JSON when they read as JSON other than a string."""
    field = ImageEditRequest.model_fields.get(name)
    if field is None:
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return text if isinstance(value, str) else value
    kinds = set(typing.get_args(field.annotation)) or {field.annotation}
    if bool in kinds:
        lowered = text.strip().lower()
        if lowered in ("true", "1"):
            return True
        if lowered in ("false", "0"):
            return False
        raise APIError(400, f"'{name}' must be true or false; got {text!r}", name, "invalid_type")
    if int in kinds:
        try:
            return int(text.strip())
        except ValueError:
            raise APIError(400, f"'{name}' must be an integer; got {text!r}", name, "invalid_type") from None
    return text


@dataclass
class EditForm:
    fields: dict[str, Any]
    images: list[bytes]


def read_form(body: bytes, content_type: str, limits: EditLimits) -> EditForm:
    """The form's text fields (typed) and its input images' files, in order; refused file fields and the image
    count are checked here."""
    fields: dict[str, Any] = {}
    images: list[bytes] = []
    for part in parse_multipart(body, content_type):
        if part.name in REFUSED_FILES:
            raise APIError(400, REFUSED_FILES[part.name], part.name, "unsupported_parameter")
        if part.name in IMAGE_FIELDS:
            images.append(part.data)
            continue
        if part.filename is not None:
            raise APIError(400, f"form field {part.name!r} is a file; only 'image' (or 'image[]') takes files here",
                           part.name, "invalid_value")
        try:
            text = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(400, f"form field {part.name!r} is not UTF-8 text", part.name, "invalid_value") from None
        name = part.name
        _insert(fields, name, text if "[" in name else _typed(name, text))
    if not images:
        raise APIError(400, "missing required parameter 'image': send the input image as the file field 'image' "
                       "(or several as 'image[]')", "image", "missing_required_parameter")
    if len(images) > MAX_INPUT_IMAGES:
        raise APIError(400, f"at most {MAX_INPUT_IMAGES} input images are accepted (the model's DiT tells at most "
                       f"{MAX_INPUT_IMAGES} references apart); got {len(images)}", "image", "too_many_images")
    total = sum(len(image) for image in images)
    if total > limits.max_total_bytes:
        raise APIError(400, f"the input images are {total} bytes together; at most {limits.max_total_bytes} are "
                       "accepted", "image", "image_too_large")
    return EditForm(fields, images)


# -- the input images ----------------------------------------------------------------------------


def _png_bit_depth(data: bytes) -> int | None:
    """The PNG's bits per sample from its IHDR (PIL opens 16-bit RGB as 8-bit RGB, so its mode does not tell)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 26:
        return data[24]
    return None


def check_image(data: bytes, index: int, limits: EditLimits) -> tuple[int, int]:
    """(width, height) of input image ``index``; a 400 naming the image and its problem otherwise."""
    from PIL import Image, UnidentifiedImageError

    what = f"input image {index}"

    def refuse(message: str, code: str = "invalid_image") -> APIError:
        return APIError(400, f"{what} {message}", "image", code)

    if not data:
        raise refuse("is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise refuse(f"is {len(data)} bytes; at most {limits.max_image_bytes} are accepted", "image_too_large")
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        png_width, png_height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        if not png_width or not png_height:  # PIL does not open such a PNG at all
            raise refuse(f"has no pixels ({png_width}x{png_height})")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            picture = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise refuse(f"has more pixels than the {limits.max_image_pixels} accepted (a decompression bomb)",
                         "image_too_large") from None
        except UnidentifiedImageError:
            raise refuse("is not an image: send a PNG, JPEG or WebP file") from None
        except Exception as exc:  # a header PIL recognises but cannot read
            raise refuse(f"is not a readable image ({type(exc).__name__}: {exc})") from None
        width, height = picture.size
        if picture.format not in FORMATS:
            raise refuse(f"is a {picture.format} file; send PNG, JPEG or WebP")
        if width < 1 or height < 1:
            raise refuse(f"has no pixels ({width}x{height})")
        if width * height > limits.max_image_pixels:
            raise refuse(f"is {width}x{height} = {width * height} pixels; at most {limits.max_image_pixels} are "
                         "accepted (a larger one may be a decompression bomb)", "image_too_large")
        if picture.mode == "CMYK":
            raise refuse("is CMYK; send an RGB (or grayscale) image")
        depth = _png_bit_depth(data)
        if (depth is not None and depth > 8) or picture.mode.startswith("I") or picture.mode == "F":
            raise refuse(f"has 16 bits per channel (mode {picture.mode}); send an 8-bit image")
        if picture.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in picture.info:
            raise refuse("has an alpha channel (transparency); send an opaque RGB image")
        if picture.mode not in MODES:
            raise refuse(f"has colour mode {picture.mode}; send an RGB (or grayscale) image")
        try:
            picture.load()
        except Exception as exc:
            raise refuse(f"is truncated or corrupt ({type(exc).__name__}: {exc})") from None
    return width, height


# -- the gRPC call --------------------------------------------------------------------------------


def edit_messages(request: ar_pb2.GenerateImageRequest, images: list[bytes]) -> Iterator[ar_pb2.EditImageInput]:
    """The EditImage stream: the request, then each image's file in pieces under the 4 MiB message default."""
    yield ar_pb2.EditImageInput(request=request)
    for index, data in enumerate(images):
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            last = start + CHUNK_BYTES >= len(data)
            yield ar_pb2.EditImageInput(
                image=common_pb2.ImageChunk(index=index, data=data[start:start + CHUNK_BYTES], last=last)
            )
