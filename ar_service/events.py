"""What the AR engine reports about a request, independent of any transport."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.status import RequestRejected

# the renderer's events, relayed as they are: events.Progress, events.PreviewImage, events.FinishedImage
from servicekit.image_events import FinishedImage as FinishedImage
from servicekit.image_events import PreviewImage as PreviewImage
from servicekit.image_events import Progress as Progress


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
