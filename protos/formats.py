"""Image output formats on the wire: the OutputFormat enum <-> the names the engines use."""

from __future__ import annotations

from protos import common_pb2

FORMAT_ENUMS: dict[str, common_pb2.OutputFormat] = {
    "png": common_pb2.OUTPUT_FORMAT_PNG,
    "jpeg": common_pb2.OUTPUT_FORMAT_JPEG,
    "webp": common_pb2.OUTPUT_FORMAT_WEBP,
}
#: The output formats both services accept, by name.
FORMATS = tuple(FORMAT_ENUMS)
_NAMES: dict[int, str] = {value: name for name, value in FORMAT_ENUMS.items()}


def format_name(value: int) -> str:
    """"png" for UNSPECIFIED (the default), the format's name, or "unknown" for a value outside the enum."""
    if value == common_pb2.OUTPUT_FORMAT_UNSPECIFIED:
        return "png"
    return _NAMES.get(value, "unknown")


def format_enum(name: str) -> common_pb2.OutputFormat:
    return FORMAT_ENUMS[name]
