"""OpenAI's ``POST /v1/images/generations``: the request and response models.

The gateway checks the shape of the standard fields (types, ranges, choices) and refuses what
ardit does not do yet (transparent backgrounds). Everything model-specific
(size multiples and limits, prompt length, the knobs) is ar_service's to judge: every extra
top-level field is forwarded as a knob, and ar_service names the parameter it refuses.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.errors import APIError
from protos.previews import MAX_PARTIAL_IMAGES

MAX_SEED = 2**63 - 1
SIZE_PATTERN = re.compile(r"^(\d+)x(\d+)$")

Quality = Literal["auto", "low", "medium", "high", "standard", "hd"]
OutputFormat = Literal["png", "jpeg", "webp"]
Background = Literal["auto", "opaque", "transparent"]


def parse_size(size: str) -> tuple[int, int]:
    """``"auto"`` -> (0, 0) (the model's default size); ``"WxH"`` -> (W, H)."""
    if size == "auto":
        return 0, 0
    match = SIZE_PATTERN.match(size)
    if match is None:
        raise ValueError(f"'size' must be 'auto' or WIDTHxHEIGHT in pixels, e.g. '1024x1024'; got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if width <= 0 or height <= 0:
        raise ValueError(f"'size' must have a positive width and height; got {size!r}")
    return width, height


class ImageGenerationRequest(BaseModel):
    """The body of ``POST /v1/images/generations``; extra fields are per-model knobs."""

    # strict: "2" is not an int and true is not an int; extra fields are kept as knobs.
    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str = Field(description="What to draw.")
    model: str | None = Field(None, description="Model id (GET /v1/models); the served model when absent.")
    n: int = Field(1, ge=1, le=10, description="Number of images, 1-10; image i uses seed + i.")
    size: str = Field("auto", description="'auto' (the model's default) or 'WIDTHxHEIGHT'.")
    quality: Quality = Field("auto", description="Maps to a num_inference_steps preset; 'auto' keeps the default.")
    response_format: Literal["b64_json", "url"] | None = Field(
        None,
        description="b64_json (in the answer) or url (kept for a while). Left out: url when the model name asked "
        "for starts with 'dall-e' (as OpenAI answers those, and as clients written for them read), else b64_json.",
    )
    output_format: OutputFormat = Field("png", description="Encoding of the returned images.")
    output_compression: int | None = Field(None, ge=0, le=100, description="0-100, jpeg and webp only.")
    background: Background | None = Field(None, description="The models draw opaque images; 'transparent' is refused.")
    user: str | None = Field(None, description="End-user id; logged with the request id, nothing else.")
    stream: bool | None = Field(False, description="Answer with server-sent events: partial images, then each image.")
    partial_images: int | None = Field(
        None, ge=0, le=MAX_PARTIAL_IMAGES,
        description=f"With stream: previews per image, 0-{MAX_PARTIAL_IMAGES}, evenly spaced over the denoising steps.",
    )
    negative_prompt: str | None = Field(None, description="What to steer away from (with guidance).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of image 0; drawn when absent.")

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, prompt: str) -> str:
        if not prompt.strip():
            raise ValueError("'prompt' must not be empty")
        return prompt

    @field_validator("size")
    @classmethod
    def _size_shape(cls, size: str) -> str:
        parse_size(size)
        return size

    @property
    def answer_format(self) -> Literal["b64_json", "url"]:
        """response_format, or what OpenAI answers for the model name when it is left out: DALL-E models default to
        url (OpenAI's Images API reference, response_format), the others to b64_json."""
        if self.response_format is not None:
            return self.response_format
        return "url" if (self.model or "").startswith("dall-e") else "b64_json"

    def dimensions(self) -> tuple[int, int]:
        return parse_size(self.size)

    @property
    def knobs(self) -> dict[str, Any]:
        """Every extra top-level field, forwarded unchanged for ar_service to validate."""
        return dict(self.model_extra or {})

    def check_supported(self) -> None:
        """Refuses valid OpenAI values that ardit does not serve (yet)."""
        if self.background == "transparent":
            raise APIError(
                400,
                "background 'transparent' is not supported: the models produce opaque images; use 'opaque' or 'auto'",
                "background",
                "unsupported_value",
            )
        if self.output_compression is not None and self.output_format == "png":
            raise APIError(
                400,
                "output_compression applies to jpeg and webp only; leave it out for png",
                "output_compression",
                "unsupported_value",
            )
        if self.partial_images and not self.stream:
            raise APIError(
                400,
                "partial_images applies to streamed requests only; send stream=true, or leave partial_images out",
                "partial_images",
                "unsupported_value",
            )


class ImageData(BaseModel):
    """One image: ``b64_json`` or ``url``, as the request's response_format asked."""

    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    seed: int


class ImagesResponse(BaseModel):
    """OpenAI's ImagesResponse, plus ardit's extras at the top level."""

    created: int
    data: list[ImageData]
    output_format: str
    size: str
    quality: str
    background: str = "opaque"
    usage: None = None
    # ardit extras
    request_id: str
    model: str
    seed: int
    seeds: list[int]
    timings: dict[str, float | int]
    knobs: dict[str, Any]
