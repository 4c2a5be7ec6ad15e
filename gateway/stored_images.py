"""Images answered by URL (``response_format: "url"``): a bounded store and the route that serves it.

Each image is kept under an unguessable name (256 random bits) for ``image_url_ttl_s`` (60 minutes by
default, as OpenAI keeps its URLs), within ``image_store_max_images`` and ``image_store_max_bytes``: a new
image first drops what has expired, then the oldest images until it fits, so nothing grows without bound.
The store lives in memory, or in a directory (``image_store_dir``) that several gateways may share: there,
a file's modification time is the moment it was stored, so every gateway reads the same expiry from it.

The URL is the capability, as OpenAI's signed URLs are: ``GET /v1/images/files/{name}`` needs no API key
(an ``<img>`` cannot send one). It answers the image with its content type and caching headers that end
with its expiry, and an unknown or expired name with a 404 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from gateway.errors import APIError
from gateway.schemas import ErrorResponse
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")

ROUTE_PREFIX = "/v1/images/files/"
CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{43}\.(png|jpeg|webp)$")  # token_urlsafe(32) + extension
TEMP_PREFIX = ".incoming-"

Clock = Callable[[], float]


@dataclass(frozen=True)
class StoredImage:
    data: bytes
    content_type: str
    expires_at: float  # on the store's clock (seconds since the epoch)


class StoreFull(ValueError):
    """The images of one response do not fit the store's limits even when it is empty."""


def new_name(output_format: str) -> str:
    if output_format not in CONTENT_TYPES:
        raise ValueError(f"unknown image format {output_format!r}; known: {', '.join(CONTENT_TYPES)}")
    return f"{secrets.token_urlsafe(32)}.{output_format}"


def content_type_of(name: str) -> str:
    return CONTENT_TYPES[name.rsplit(".", 1)[1]]


class ImageStore(ABC):
    """Bounded by count and bytes, every image expires ``ttl_s`` after it was stored."""

    def __init__(self, max_images: int, max_bytes: int, ttl_s: float, clock: Clock = time.time):
        if max_images < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("an image store needs max_images >= 1, max_bytes >= 1 and ttl_s > 0")
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()

    def put_all(self, images: Sequence[bytes], output_format: str) -> list[str]:
        """Stores the images of one response; their names, in order. Older images make room."""
        total = sum(len(data) for data in images)
        if len(images) > self.max_images or total > self.max_bytes:
            raise StoreFull(
                f"{len(images)} image(s) of {total} bytes do not fit the URL store (at most {self.max_images} images, "
                f"{self.max_bytes} bytes); ask for response_format 'b64_json'"
            )
        names = [new_name(output_format) for _ in images]
        with self._lock:
            self._make_room(len(images), total)
            for name, data in zip(names, images, strict=True):
                self._write(name, data)
        return names

    def get(self, name: str) -> StoredImage | None:
        """The image, or None when the name is unknown, malformed or expired (an expired one is dropped)."""
        if not NAME_PATTERN.match(name):
            return None
        with self._lock:
            return self._read(name)

    def sweep(self) -> int:
        """Drops every expired image; how many."""
        with self._lock:
            return self._make_room(0, 0)

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """(images, bytes) held now, expired ones included until the next sweep."""

    @abstractmethod
    def _make_room(self, count: int, size: int) -> int:
        """Drops the expired, then the oldest, until ``count`` more images of ``size`` bytes fit; how many dropped."""

    @abstractmethod
    def _write(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    def _read(self, name: str) -> StoredImage | None: ...


class MemoryImageStore(ImageStore):
    """In this process; lost on restart. Insertion order is age order (one ttl for all)."""

    def __init__(self, max_images: int, max_bytes: int, ttl_s: float, clock: Clock = time.time):
        super().__init__(max_images, max_bytes, ttl_s, clock)
        self._images: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # name -> (data, stored at)
        self._bytes = 0

    def usage(self) -> tuple[int, int]:
        return len(self._images), self._bytes

    def _drop_oldest(self) -> None:
        _, (data, _) = self._images.popitem(last=False)
        self._bytes -= len(data)

    def _make_room(self, count: int, size: int) -> int:
        dropped = 0
        now = self.clock()
        while self._images and (
            next(iter(self._images.values()))[1] + self.ttl_s <= now
            or len(self._images) + count > self.max_images
            or self._bytes + size > self.max_bytes
        ):
            self._drop_oldest()
            dropped += 1
        return dropped

    def _write(self, name: str, data: bytes) -> None:
        self._images[name] = (data, self.clock())
        self._bytes += len(data)

    def _read(self, name: str) -> StoredImage | None:
        entry = self._images.get(name)
        if entry is None:
            return None
        data, stored_at = entry
        if stored_at + self.ttl_s <= self.clock():
            del self._images[name]
            self._bytes -= len(data)
            return None
        return StoredImage(data, content_type_of(name), stored_at + self.ttl_s)


@dataclass(frozen=True)
class _File:
    path: Path
    stored_at: float
    size: int


class DirectoryImageStore(ImageStore):
    """One file per image in ``directory``; a file's mtime is when it was stored (set from the store's clock).

    Gateways sharing the directory see each other's images; each new image brings the directory back within
    the limits (two gateways storing at once may overshoot them briefly, never for long).
    """

    def __init__(self, directory: Path, max_images: int, max_bytes: int, ttl_s: float, clock: Clock = time.time):
        super().__init__(max_images, max_bytes, ttl_s, clock)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._make_room(0, 0)  # what an earlier run (or smaller limits) left behind

    def _files(self) -> list[_File]:
        """Stored images, oldest first; leftover partial writes older than the ttl are removed."""
        files = []
        now = self.clock()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed by another gateway meanwhile
                if entry.name.startswith(TEMP_PREFIX) and stat.st_mtime + self.ttl_s <= now:
                    Path(entry.path).unlink(missing_ok=True)
                elif entry.is_file(follow_symlinks=False) and NAME_PATTERN.match(entry.name):
                    files.append(_File(Path(entry.path), stat.st_mtime_ns / 1e9, stat.st_size))
        files.sort(key=lambda file: (file.stored_at, file.path.name))
        return files

    def usage(self) -> tuple[int, int]:
        files = self._files()
        return len(files), sum(file.size for file in files)

    def _make_room(self, count: int, size: int) -> int:
        files = self._files()
        held = sum(file.size for file in files)
        now = self.clock()
        dropped = 0
        for file in files:
            expired = file.stored_at + self.ttl_s <= now
            if not (expired or len(files) - dropped + count > self.max_images or held + size > self.max_bytes):
                break
            file.path.unlink(missing_ok=True)
            held -= file.size
            dropped += 1
        return dropped

    def _write(self, name: str, data: bytes) -> None:
        temp = self.directory / f"{TEMP_PREFIX}{name}"
        temp.write_bytes(data)
        stored_ns = int(self.clock() * 1e9)
        os.utime(temp, ns=(stored_ns, stored_ns))
        os.replace(temp, self.directory / name)  # readers never see half an image

    def _read(self, name: str) -> StoredImage | None:
        path = self.directory / name
        try:
            stored_at = path.stat().st_mtime_ns / 1e9
            if stored_at + self.ttl_s <= self.clock():
                path.unlink(missing_ok=True)
                return None
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        return StoredImage(data, content_type_of(name), stored_at + self.ttl_s)


def open_store(settings: GatewaySettings, clock: Clock = time.time) -> ImageStore:
    """The store the settings ask for: a directory when ``image_store_dir`` is set, else memory."""
    limits = (settings.image_store_max_images, settings.image_store_max_bytes, settings.image_url_ttl_s)
    if settings.image_store_dir is not None:
        return DirectoryImageStore(settings.image_store_dir, *limits, clock=clock)
    return MemoryImageStore(*limits, clock=clock)


async def sweep_forever(store: ImageStore) -> None:
    """Drops expired images every ``min(60 s, ttl / 2)``, so that an idle gateway lets go of them too."""
    interval_s = min(60.0, store.ttl_s / 2)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run_in_threadpool(store.sweep)
        except OSError as exc:  # e.g. a shared directory briefly unavailable: try again next time
            log.warning("sweeping the image store failed: %s", exc)


def image_url(request: Request, name: str) -> str:
    """The image's absolute URL: under ``base_url`` when set, else under the URL the client used."""
    base = request.app.state.settings.base_url or str(request.base_url).rstrip("/")
    return f"{base}{ROUTE_PREFIX}{name}"


async def publish(request: Request, images: Sequence[Any], output_format: str) -> dict[int, str]:
    """Stores a response's images (GeneratedImage messages); their URLs by image index."""
    store: ImageStore = request.app.state.image_store
    try:
        names = await run_in_threadpool(store.put_all, [image.data for image in images], output_format)
    except StoreFull as exc:
        raise APIError(400, str(exc), "response_format", "image_store_full") from None
    return {image.index: image_url(request, name) for image, name in zip(images, names, strict=True)}


# -- the route ---------------------------------------------------------------------------------

router = APIRouter()

_NOT_FOUND = "image not found: the URL is unknown or has expired (images are kept {ttl:g} s after they are made)"


@router.get(
    ROUTE_PREFIX + "{name}",
    summary="An image answered by URL",
    responses={
        200: {"content": {media: {} for media in CONTENT_TYPES.values()}, "description": "The image"},
        304: {"description": "Not modified (If-None-Match)"},
        404: {"model": ErrorResponse, "description": "Unknown or expired image"},
    },
    response_class=Response,
)
async def stored_image(name: str, request: Request) -> Response:
    store: ImageStore = request.app.state.image_store
    image = await run_in_threadpool(store.get, name)
    if image is None:
        raise APIError(404, _NOT_FOUND.format(ttl=store.ttl_s), None, "image_not_found", headers={"Cache-Control": "no-store"})
    left_s = max(0, int(image.expires_at - store.clock()))
    headers = {
        # The bytes behind a name never change; private: the URL is a capability, shared caches keep out.
        "Cache-Control": f"private, max-age={left_s}, immutable",
        "Expires": formatdate(image.expires_at, usegmt=True),
        "ETag": f'"{name}"',
        "X-Content-Type-Options": "nosniff",
    }
    if request.headers.get("if-none-match") in (f'"{name}"', f'W/"{name}"'):
        return Response(status_code=304, headers=headers)
    return Response(image.data, media_type=image.content_type, headers=headers)
