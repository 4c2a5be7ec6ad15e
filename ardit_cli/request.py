"""What the command line asks for, independent of the transport that carries it, and the errors it reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class CLIError(Exception):
    """A failure to report as ``error: <message>`` with exit status 1 (no traceback)."""


@dataclass
class ImageRequest:
    prompt: str
    size: str = "auto"
    n: int = 1
    seed: int | None = None
    negative_prompt: str | None = None
    model: str | None = None
    quality: str = "auto"
    output_format: str = "png"
    output_compression: int | None = None
    partial_images: int = 0
    knobs: dict[str, Any] = field(default_factory=dict)  # the model's knobs, by their table names
    #: An edit's input images (encoded files, in order); empty for text to image.
    images: list[bytes] = field(default_factory=list)
    #: The input images' file names (for the multipart form).
    image_names: list[str] = field(default_factory=list)


class Reporter(Protocol):
    """Receives what a transport learns while the request runs (progress/reporter.py draws and writes it)."""


    def progress(self, index: int, stage: str, step: int, total: int) -> None: ...

    def preview(self, index: int, partial_index: int, data: bytes) -> None: ...

    def image(self, index: int, seed: int, data: bytes, width: int, height: int) -> None: ...

    def completed(self, request_id: str, seed: int, timings: dict[str, Any]) -> None: ...
