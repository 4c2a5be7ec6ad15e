"""OpenAI's ``POST /v1/images/generations``: the request and response models.

The gateway takes every field of OpenAI's request body with the values OpenAI documents for it. Sources, read for
this list: OpenAI's API reference, "Create image" (developers.openai.com/api/reference/resources/images/methods/generate),
and openai-python 3.63's ``openai/types/image_generate_params.py`` and ``image_model.py``, which are generated from
OpenAI's OpenAPI spec. A field (or value) that changes nothing for the served model is accepted and named in the
answer (``ignored_fields`` and the ``X-Ardit-Ignored-Fields`` header; :meth:`ImageGenerationRequest.ignored_fields`),
never refused. A value outside OpenAI's set is a 400 naming the field and the accepted values. A valid value that
ardit cannot honour and that a client would misread if it were dropped (a transparent background, GIF or SVG output)
is a 400 saying so, as OpenAI answers a model that lacks the feature.

Everything model-specific (size multiples and limits, prompt length, the knobs) is ar_service's to judge: every
top-level field that is not OpenAI's is forwarded as a knob, ar_service names the parameter it refuses, and an
unknown knob is a 400 listing the accepted ones.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.errors import APIError
from protos.formats import FORMATS
from protos.previews import MAX_PARTIAL_IMAGES

MAX_SEED = 2**63 - 1
SIZE_PATTERN = re.compile(r"^(\d+)x(\d+)$")

# The value sets, as OpenAI's reference and openai-python 3.63 (image_generate_params.py) list them.
#: quality: "auto" (default), "low", "medium", "high" (GPT image models), "xhigh" and "max" (gpt-image-2.5 models),
#: "standard" and "hd" (DALL-E 3; deprecated values, still listed).
Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]
#: output_format: "png" (default), "jpeg", "webp", "gif" (animated, with frame_count), "svg".
OutputFormat = Literal["png", "jpeg", "webp", "gif", "svg"]
#: background: "auto" (default), "opaque", "transparent".
Background = Literal["auto", "opaque", "transparent"]
#: style (DALL-E 3, "legacy"): "vivid", "natural".
Style = Literal["vivid", "natural"]
#: moderation: "low", "auto" (default).
Moderation = Literal["low", "auto"]
#: complexity: computation spent planning the image, independently of quality: "low", "medium", "high".
Complexity = Literal["low", "medium", "high"]
#: svg.reasoning.effort.
SvgEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
#: frame_count: frames of a GIF, 2 through 16 (only with output_format gif).
MIN_FRAMES, MAX_FRAMES = 2, 16

#: The qualities ar_service has presets for; OpenAI's newer "xhigh" and "max" take the highest of them.
QUALITY_PRESET = {"xhigh": "high", "max": "high"}
#: Fields OpenAI documents as nullable whose null means "the default": dropped before validation.
_NULL_IS_DEFAULT = ("n", "size", "quality", "output_format", "stream")


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


def _or_null(schema: dict[str, Any]) -> None:
    """The field's JSON schema also admits null (OpenAI documents null as "the default" for it)."""
    inner = {key: schema.pop(key) for key in list(schema) if key not in ("title", "description", "default")}
    schema["anyOf"] = [inner, {"type": "null"}]


class SvgReasoning(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    effort: SvgEffort | None = None


class SvgOptions(BaseModel):
    """OpenAI's ``svg`` object (the model and reasoning effort that author SVG output)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    reasoning: SvgReasoning | None = None


class ImageGenerationRequest(BaseModel):
    """The body of ``POST /v1/images/generations``: OpenAI's fields, and any other top-level field as a knob."""

    # strict: "2" is not an int and true is not an int; extra fields are kept as knobs.
    model_config = ConfigDict(extra="allow", strict=True)

    prompt: str = Field(description="What to draw.")
    model: str | None = Field(None, description="Model id (GET /v1/models) or alias; the served model when absent.")
    n: int = Field(1, ge=1, le=10, json_schema_extra=_or_null,
                   description="Number of images, 1-10; image i uses seed + i.")
    size: str = Field("auto", json_schema_extra=_or_null, description="'auto' (the model's default) or 'WIDTHxHEIGHT'.")
    quality: Quality = Field(
        "auto", json_schema_extra=_or_null,
        description="A num_inference_steps preset ('xhigh' and 'max': the 'high' one); 'auto' keeps the default; "
        "without effect when the request gives num_inference_steps.",
    )
    response_format: Literal["b64_json", "url"] | None = Field(
        None,
        description="b64_json (in the answer) or url (kept for a while). Left out: url when the model name asked "
        "for starts with 'dall-e' (as OpenAI answers those, and as clients written for them read), else b64_json. "
        "Without effect with stream (events carry b64_json).",
    )
    output_format: OutputFormat = Field(
        "png", json_schema_extra=_or_null,
        description="Encoding of the returned images: png, jpeg or webp ('gif' and 'svg' are refused).",
    )
    output_compression: int | None = Field(
        None, ge=0, le=100, description="0-100, for jpeg and webp; without effect for png (lossless)."
    )
    background: Background | None = Field(
        None, description="'auto' and 'opaque' give the opaque images the models draw; 'transparent' is refused."
    )
    moderation: Moderation | None = Field(None, description="Without effect: the gateway moderates nothing.")
    style: Style | None = Field(None, description="Without effect: the models have no style setting (say it in the "
                                "prompt).")
    complexity: Complexity | None = Field(None, description="Without effect: the models have no planning setting.")
    frame_count: int | None = Field(None, ge=MIN_FRAMES, le=MAX_FRAMES,
                                    description="GIF frames; without effect (GIF output is refused).")
    frame_duration_ms: int | None = Field(None, ge=0, description="GIF frame delay; without effect (GIF output is "
                                          "refused).")
    svg: SvgOptions | None = Field(None, description="SVG authoring; without effect (SVG output is refused).")
    user: str | None = Field(None, description="End-user id; logged with the request id, nothing else.")
    safety_identifier: str | None = Field(
        None, description="End-user id (OpenAI's successor of user, which it overrides when not empty); logged with "
        "the request id, nothing else.",
    )
    stream: bool = Field(False, json_schema_extra=_or_null,
                         description="Answer with server-sent events: partial images, then each image.")
    partial_images: int | None = Field(
        None, ge=0, le=MAX_PARTIAL_IMAGES,
        description=f"With stream: previews per image, 0-{MAX_PARTIAL_IMAGES}, evenly spaced over the denoising steps; "
        "without effect without stream.",
    )
    negative_prompt: str | None = Field(None, description="What to steer away from (with guidance).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of image 0; drawn when absent.")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, body: Any) -> Any:
        if isinstance(body, dict):
            return {key: value for key, value in body.items() if not (value is None and key in _NULL_IS_DEFAULT)}
        return body

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

    @property
    def end_user(self) -> str | None:
        """Who the request is for, as OpenAI reads it: a non-empty safety_identifier, else user."""
        return self.safety_identifier or self.user

    @property
    def quality_preset(self) -> str:
        """The quality ar_service is asked for: the request's, with "xhigh" and "max" as its highest preset."""
        return QUALITY_PRESET.get(self.quality, self.quality)

    def dimensions(self) -> tuple[int, int]:
        return parse_size(self.size)

    @property
    def knobs(self) -> dict[str, Any]:
        """Every extra top-level field, forwarded unchanged for ar_service to validate."""
        return dict(self.model_extra or {})

    def ignored_fields(self) -> list[str]:
        """The OpenAI fields this request gives that change nothing here, sorted (the README says why for each)."""
        ignored = {
            name for name in ("moderation", "style", "complexity", "frame_count", "frame_duration_ms", "svg")
            if getattr(self, name) is not None
        }
        if self.output_compression is not None and self.output_format == "png":
            ignored.add("output_compression")  # PNG is lossless
        if self.partial_images is not None and not self.stream:
            ignored.add("partial_images")
        if self.response_format == "url" and self.stream:
            ignored.add("response_format")  # a stream's events carry b64_json
        if self.quality != "auto" and "num_inference_steps" in self.knobs:
            ignored.add("quality")  # the steps asked for win over the quality's preset
        return sorted(ignored)

    def check_supported(self) -> None:
        """Refuses valid OpenAI values that ardit cannot honour and that a client would misread if they were dropped."""
        if self.background == "transparent":
            # OpenAI answers an error too for a model without transparent backgrounds (gpt-image-2: "Requests with
            # background set to transparent will return an error for these models; use opaque or auto instead").
            raise APIError(
                400,
                "background 'transparent' is not supported: the models produce opaque images; use 'opaque' or 'auto'",
                "background",
                "unsupported_value",
            )
        if self.output_format not in FORMATS:
            raise APIError(
                400,
                f"output_format {self.output_format!r} is not supported: the models draw one still raster image; "
                f"use {', '.join(repr(name) for name in FORMATS)}",
                "output_format",
                "unsupported_value",
            )


def accepted_values(name: str) -> str | None:
    """What a top-level field of the request accepts, in words ("one of 'vivid', 'natural'", "an integer from 0 to
    100"), from its declaration; None for a field that is not OpenAI's (a knob) or an object."""
    field = ImageGenerationRequest.model_fields.get(name)
    if field is None:
        return None
    annotation = field.annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = options[0] if len(options) == 1 else annotation
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(value) for value in typing.get_args(annotation))
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return "a string, 'auto' or WIDTHxHEIGHT (e.g. '1024x1024')" if name == "size" else "a string"
    if annotation is int:
        low = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
        high = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
        if low is not None and high is not None:
            return f"an integer from {low} to {high}"
        if low is not None:
            return f"an integer >= {low}"
        return "an integer"
    return None


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
    ignored_fields: list[str] = Field(
        default_factory=list,
        description="OpenAI fields the request gave that changed nothing here (also in the X-Ardit-Ignored-Fields "
        "header); empty when every field took effect",
    )
