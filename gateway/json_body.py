"""JSON bodies that carry pictures: each ``b64_json`` text written in as it is, the rest as Starlette renders JSON.

Why: a 1024x1024 PNG is 2-4 MB of base64. Through ``json.dumps`` it is scanned for characters to escape, copied into
the dumped text, and copied again into UTF-8 bytes, on the request's path between the last denoise step and the
client (for a 2.7 MB picture, 19-29 ms on a two-core machine, 2.6 ms spliced; on an H100's host the time from the
services' end to the client's answer fell from 91-119 to 29-37 ms, bench/results/h100/c1-step-overlap). The base64
alphabet holds no character JSON escapes, so that text goes into the body unscanned. The bytes are those
``JSONResponse`` renders (``ensure_ascii=False``, no NaN, compact separators); a ``b64_json`` value that is not plain
base64 text is rendered the ordinary way.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

PICTURE_KEY = "b64_json"


def dumps(value: Any) -> bytes:
    """``value`` (dicts with str keys, lists, JSON scalars) as compact UTF-8 JSON, pictures spliced in."""
    parts: list[bytes] = []
    _write(value, parts)
    return b"".join(parts)  # one copy of each picture: concatenating bytes would copy it at every level


def _write(value: Any, parts: list[bytes]) -> None:
    if isinstance(value, dict):
        parts.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys here are str; got {key!r}")
            parts.append(b"," + _scalar(key) + b":" if i else _scalar(key) + b":")
            if key == PICTURE_KEY and _plain_base64(item):
                parts += (b'"', item.encode("ascii"), b'"')
            else:
                _write(item, parts)
        parts.append(b"}")
    elif isinstance(value, list | tuple):
        parts.append(b"[")
        for i, item in enumerate(value):
            if i:
                parts.append(b",")
            _write(item, parts)
        parts.append(b"]")
    else:
        parts.append(_scalar(value))


def _scalar(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _plain_base64(value: Any) -> bool:
    """Text JSON writes as it is (isascii() is O(1) on CPython's compact strings; the searches run at memchr speed)."""
    return isinstance(value, str) and value.isascii() and '"' not in value and "\\" not in value


class PicturesJSONResponse(JSONResponse):
    """A ``JSONResponse`` whose body is rendered by ``dumps``."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
