"""What the AR engine reports about a request, independent of any transport."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.status import RequestRejected


@dataclass(frozen=True)
class Progress:
    index: int
    stage: str  # "ar_decode" (rows) or "denoise" (steps)
    step: int
    total: int


@dataclass(frozen=True)
class FinishedImage:
    index: int
    seed: int
    format: str
    data: bytes
    width: int
    height: int


@dataclass(frozen=True)
class PreviewImage:
    """A partial image of image ``index`` from the renderer, after ``step`` of ``total`` denoising steps."""

    index: int
    partial_index: int
    step: int
    total: int
    format: str
    data: bytes
    width: int
    height: int


@dataclass(frozen=True)
class TokenRow:
    index: int
    seed: int
    grid_width: int
    grid_height: int
    row: int
    token_ids: list[int]


@dataclass(frozen=True)
class ConditionReceived:
    """The renderer holds image ``index``'s whole condition."""

    index: int


@dataclass(frozen=True)
class RenderDone:
    index: int
    timings: dict[str, float]


@dataclass(frozen=True)
class RenderFailed:
    index: int
    error: RequestRejected


@dataclass(frozen=True)
class JobDone:
    seed: int
    knobs: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class JobFailed:
    error: RequestRejected
