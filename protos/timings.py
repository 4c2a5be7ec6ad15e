"""The engines' per-stage timing dicts -> the StageTimings message both services answer with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protos import common_pb2

TIMING_FIELDS = frozenset(f.name for f in common_pb2.StageTimings.DESCRIPTOR.fields)


def stage_timings(values: Mapping[str, float]) -> common_pb2.StageTimings:
    """Fills the fields the message has; other names (an engine's private timings) are left out.

    The message mixes double durations with uint32 counts, which one dict value type cannot say: the
    engines keep counts as ints, and protobuf refuses a float for a count.
    """
    fields: dict[str, Any] = {name: value for name, value in values.items() if name in TIMING_FIELDS}
    return common_pb2.StageTimings(**fields)
