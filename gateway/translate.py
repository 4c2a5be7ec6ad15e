"""OpenAI <-> proto translation; pure functions, no I/O."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.protocol import ImageData, ImageGenerationRequest, ImagesResponse
from protos import ar_pb2, common_pb2
from protos.formats import format_enum
from protos.values import from_value, knobs_from_proto, knobs_to_proto

#: The response header that names the OpenAI fields a request gave without effect (beside the answer's
#: ``ignored_fields``); absent when every field took effect.
IGNORED_FIELDS_HEADER = "X-Ardit-Ignored-Fields"


def new_request_id() -> str:
    return f"img-{uuid.uuid4().hex}"


def to_proto(
    request: ImageGenerationRequest, request_id: str | None = None, model_aliases: Mapping[str, str] | None = None
) -> ar_pb2.GenerateImageRequest:
    """The OpenAI request as one GenerateImageRequest (width/height 0 for size 'auto'); a model name that is one of
    the gateway's aliases becomes the model it stands for, any other goes to ar_service as given (404 if unknown).
    Fields without effect (ImageGenerationRequest.ignored_fields) are not sent."""
    width, height = request.dimensions()
    model = request.model or ""
    message = ar_pb2.GenerateImageRequest(
        request_id=request_id or new_request_id(),
        model=(model_aliases or {}).get(model, model),
        prompt=request.prompt,
        negative_prompt=request.negative_prompt or "",
        width=width,
        height=height,
        n=request.n,
        output_format=format_enum(request.output_format),
        quality=request.quality_preset,
        knobs=knobs_to_proto(request.knobs),
    )
    if request.seed is not None:
        message.seed = request.seed
    if request.output_compression is not None and request.output_format != "png":
        message.output_compression = request.output_compression
    if request.stream and request.partial_images:
        message.partial_images = request.partial_images
    return message


def ignored_fields_headers(request: ImageGenerationRequest) -> dict[str, str]:
    """The X-Ardit-Ignored-Fields header for an answer to ``request``, when it gave fields without effect."""
    ignored = request.ignored_fields()
    return {IGNORED_FIELDS_HEADER: ", ".join(ignored)} if ignored else {}


def timings_to_dict(timings: common_pb2.StageTimings, gateway_ms: float | None = None) -> dict[str, float | int]:
    """Every StageTimings field by name (ms, counts as ints), plus the gateway's own time."""
    result: dict[str, float | int] = {field.name: getattr(timings, field.name) for field in timings.DESCRIPTOR.fields}
    if gateway_ms is not None:
        result["gateway_ms"] = round(gateway_ms, 3)
    return result


def to_openai(
    request: ImageGenerationRequest,
    images: Iterable[common_pb2.GeneratedImage],
    completed: ar_pb2.GenerateImageResponse,
    gateway_ms: float | None = None,
    created: int | None = None,
    urls: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The streamed images and the final summary as OpenAI's ImagesResponse (plus ardit extras).

    With ``urls`` (image index -> URL, for response_format "url") each image is its URL, else its base64 bytes.
    """
    ordered = sorted(images, key=lambda image: image.index)
    if urls is None:
        data = [ImageData(b64_json=base64.b64encode(image.data).decode("ascii"), seed=image.seed) for image in ordered]
    else:
        data = [ImageData(url=urls[image.index], seed=image.seed) for image in ordered]
    response = ImagesResponse(
        created=int(time.time()) if created is None else created,
        data=data,
        output_format=request.output_format,
        size=f"{completed.width}x{completed.height}",
        quality=request.quality,
        request_id=completed.request_id,
        model=completed.model,
        seed=completed.seed,
        seeds=[image.seed for image in ordered],
        timings=timings_to_dict(completed.timings, gateway_ms),
        knobs=knobs_from_proto(completed.knobs),
        ignored_fields=request.ignored_fields(),
    )
    content = response.model_dump()
    absent = "b64_json" if urls is not None else "url"
    for item in content["data"]:
        del item[absent]  # as OpenAI answers: one of the two, never a null other
    return content


def model_card_to_openai(card: ar_pb2.ModelCard) -> dict[str, Any]:
    """One ModelCard in OpenAI's model shape, ardit's details under "ardit"."""
    knobs = [
        {
            "name": knob.name,
            "type": knob.type,
            "default": from_value(knob.default) if knob.HasField("default") else None,
            "minimum": _number(knob.minimum) if knob.HasField("minimum") else None,
            "maximum": _number(knob.maximum) if knob.HasField("maximum") else None,
            "choices": list(knob.choices) or None,
            "description": knob.description,
        }
        for knob in card.knobs
    ]
    return {
        "id": card.id,
        "object": "model",
        "created": 0,
        "owned_by": "ardit",
        "ardit": {
            "family": card.family,
            "member": card.member or None,
            "default_size": f"{card.default_width}x{card.default_height}",
            "max_side": card.max_side,
            "size_multiple": card.size_multiple,
            "max_prompt_tokens": card.max_prompt_tokens,
            "knobs": knobs,
            "quality_steps": dict(card.quality_steps),
            "max_upscale": card.max_upscale or 1,
            "grid": _grid_rule(card.grid) if card.HasField("grid") else None,
            "alias_of": None,
        },
    }


def _grid_rule(grid: ar_pb2.GridRule) -> dict[str, Any]:
    """The card's grid rule with the parameter its rule reads: ``tokens`` or ``pixels_per_token``."""
    if grid.rule == "pixels_per_token":
        return {"rule": grid.rule, "pixels_per_token": grid.pixels_per_token}
    return {"rule": grid.rule, "tokens": grid.tokens}


def models_to_openai(reply: ar_pb2.ListModelsResponse, model_aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The served models first, then each alias of a served model as an entry of its own whose ``ardit.alias_of``
    names the model it stands for (its details are that model's). An alias of a model not served is left out."""
    served = [model_card_to_openai(card) for card in reply.models]
    by_id = {entry["id"]: entry for entry in served}
    aliases = [
        {**by_id[model], "id": alias, "ardit": {**by_id[model]["ardit"], "alias_of": model}}
        for alias, model in (model_aliases or {}).items()
        if model in by_id
    ]
    return {"object": "list", "data": served + aliases}


def _number(value: float) -> int | float:
    """Whole numbers as ints (a minimum of 1 reads as 1, not 1.0)."""
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else value
