"""Knob values on the wire: google.protobuf.Value <-> plain Python."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import struct_pb2


def to_value(obj: Any) -> struct_pb2.Value:
    """Wraps a JSON-like Python value (None, bool, number, str, list, dict)."""
    value = struct_pb2.Value()
    if obj is None:
        value.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        value.bool_value = obj
    elif isinstance(obj, (int, float)):
        value.number_value = float(obj)
    elif isinstance(obj, str):
        value.string_value = obj
    elif isinstance(obj, (list, tuple)):
        value.list_value.values.extend(to_value(item) for item in obj)
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            value.struct_value.fields[str(key)].CopyFrom(to_value(item))
    else:
        raise TypeError(f"cannot send a {type(obj).__name__} as a knob value")
    return value


def from_value(value: struct_pb2.Value) -> Any:
    """Unwraps a Value; whole numbers come back as int, others as float."""
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [from_value(item) for item in value.list_value.values]
    return {key: from_value(item) for key, item in value.struct_value.fields.items()}


def knobs_to_proto(knobs: Mapping[str, Any]) -> dict[str, struct_pb2.Value]:
    return {name: to_value(item) for name, item in knobs.items()}


def knobs_from_proto(knobs: Mapping[str, struct_pb2.Value]) -> dict[str, Any]:
    return {name: from_value(item) for name, item in knobs.items()}
