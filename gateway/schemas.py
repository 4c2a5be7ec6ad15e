"""Response models for the OpenAPI document: what each route really answers, errors included.

The routes build their JSON by hand (gateway/translate.py); these models only describe it, so that
a schema-driven fuzzer (bench/fuzz.py, tests/e2e/test_fuzz_openapi.py) can check every answer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocol import ImagesResponse
from gateway.translate import IGNORED_FIELDS_HEADER


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used by every 4xx and 5xx."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class KnobInfo(BaseModel):
    name: str
    type: str
    default: Any = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    choices: list[str] | None = None
    description: str


class GridRuleInfo(BaseModel):
    rule: Literal["token_budget", "pixels_per_token"] = Field(
        description="how the AR's visual-token grid follows the rendered size: about `tokens` visual tokens at the "
        "image's aspect ratio (token_budget), or one token per `pixels_per_token` pixels along each side")
    tokens: int | None = Field(None, description="token_budget: the grid's size in tokens, about (1024: 32x32 when square)")
    pixels_per_token: int | None = Field(None, description="pixels_per_token: pixels per visual token along each side")


class ArditModelInfo(BaseModel):
    family: str
    default_size: str
    max_side: int
    size_multiple: int
    max_prompt_tokens: int
    knobs: list[KnobInfo]
    quality_steps: dict[str, int]
    max_upscale: int = Field(description="sizes above max_side are rendered at most max_side and enlarged by a whole "
                             "factor up to this (1: never)")
    grid: GridRuleInfo | None = Field(description="the visual-token grid a size gets (absent from older servers)")
    alias_of: str | None = Field(description="for a gateway alias (setting model_aliases): the served model it stands for")


class ModelObject(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    ardit: ArditModelInfo


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelObject]


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]
    ar: str
    dit: str
    fault: str | None = Field(None, description="why renders fail though both serve, when the AR knows (e.g. its DiT "
                              "serves another model); absent otherwise")


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


#: One event of an image stream as an SSE parser reads it (the stream's comments are not events): ``data`` is an
#: OpenAI image event or error as JSON, or ``[DONE]`` (gateway/streaming.py).
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
    "required": ["data"],
}

#: Errors any route may answer (the middleware's, and the services' mapped statuses).
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _error("Missing or incorrect API key (only when the gateway is configured with keys)"),
    413: _error("Request body larger than max_body_bytes"),
    500: _error("Unexpected error in the gateway or a service"),
    503: _error("ar_service or dit_service is unavailable"),
    504: _error("The request did not finish within request_timeout_s"),
}

GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": ImagesResponse,
        "description": "The images, in OpenAI's shape plus ardit's extras; with stream, server-sent events "
        "(image_generation.partial_image, image_generation.completed, error; see gateway/streaming.py)",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
        "headers": {
            IGNORED_FIELDS_HEADER: {
                "description": "The OpenAI fields the request gave that changed nothing here, comma-separated "
                "(as the answer's ignored_fields); absent when every field took effect",
                "schema": {"type": "string"},
            },
        },
    },
    400: _error("Invalid or unsupported input; error.param names the field"),
    404: _error("Unknown model"),
    429: _error("A service refused for load; see Retry-After"),
    499: _error("The client closed the request"),
    502: _error("ar_service answered without a final result"),
    **COMMON_ERRORS,
}

MODELS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ModelList, "description": "The served models"},
    **COMMON_ERRORS,
}

MODEL_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ModelObject, "description": "One served model"},
    404: _error("Unknown model"),
    **COMMON_ERRORS,
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": HealthResponse, "description": "Both services answer SERVING"},
    503: {"model": HealthResponse, "description": "A service is not serving (state of each)"},
}
