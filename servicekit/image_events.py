"""The image events both stages report, whatever the transport: progress, a preview, a finished image.

The AR service relays the renderer's events to its caller as they are, so both engines speak these classes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Image ``index`` is at ``step`` of ``total`` in ``stage`` ("ar_decode" counts rows, "denoise" steps)."""

    index: int
    stage: str
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
    """A partial image of image ``index``: what the denoise predicts after ``step`` of ``total`` steps."""

    index: int
    partial_index: int
    step: int
    total: int
    format: str
    data: bytes
    width: int
    height: int
