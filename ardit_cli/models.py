"""The served models' cards, as the server publishes them (ListModels over gRPC, ``GET /v1/models`` over REST).

The command line's knob options are made from these at run time, so they are always the model's own table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KnobSpec:
    name: str
    type: str  # "int", "float", "string", "float_pair"
    default: Any
    minimum: float | None
    maximum: float | None
    choices: tuple[str, ...]
    description: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        parts = []
        if self.minimum is not None:
            parts.append(f">= {_number(self.minimum)}")
        if self.maximum is not None:
            parts.append(f"<= {_number(self.maximum)}")
        return " and ".join(parts)

    def default_text(self) -> str:
        if self.default is None:
            return "the server's" if self.name != "seed" else "drawn"
        if isinstance(self.default, list):
            return " ".join(_number(v) for v in self.default)
        return _number(self.default) if isinstance(self.default, (int, float)) else str(self.default)


@dataclass(frozen=True)
class ModelCard:
    id: str
    family: str
    default_size: str
    max_side: int
    size_multiple: int
    max_prompt_tokens: int
    knobs: tuple[KnobSpec, ...]
    quality_steps: dict[str, int]
    grid: dict[str, Any] | None = None  # the server's grid rule: {"rule", and "tokens" or "pixels_per_token"}
    member: str = ""  # the family's released member ("preview", "dev"); "" when the server does not say

    @property
    def kind(self) -> str:
        """The family and its member, as ``ardit models`` prints them ("mammothmoda2 dev")."""
        return f"{self.family} {self.member}" if self.member else self.family

    def grid_text(self) -> str:
        """The visual-token grid a size gets, in words ("" when the server does not say)."""
        rule = self.grid or {}
        if rule.get("rule") == "pixels_per_token":
            ppt = rule.get("pixels_per_token", 0)
            return f"one visual token per {ppt}x{ppt} pixels"
        if rule.get("rule") == "token_budget":
            tokens = rule.get("tokens", 0)
            side = math.isqrt(tokens)
            square = f" ({side}x{side} for a square)" if side * side == tokens else ""
            return f"about {tokens} visual tokens at the image's aspect ratio{square}"
        return ""

    @classmethod
    def from_json(cls, model: dict[str, Any]) -> ModelCard:
        """One entry of ``GET /v1/models``'s ``data`` (ardit's details under ``ardit``)."""
        details = model.get("ardit") or {}
        knobs = tuple(
            KnobSpec(k["name"], k["type"], k.get("default"), k.get("minimum"), k.get("maximum"),
                     tuple(k.get("choices") or ()), k.get("description", ""))
            for k in details.get("knobs", ())
        )
        return cls(model["id"], details.get("family", ""), details.get("default_size", "auto"), details.get("max_side", 0),
                   details.get("size_multiple", 0), details.get("max_prompt_tokens", 0), knobs,
                   dict(details.get("quality_steps", {})), details.get("grid"), details.get("member") or "")

    @classmethod
    def from_proto(cls, card: Any) -> ModelCard:
        """One ``ardit.v1.ModelCard`` of ListModels."""
        from protos.values import from_value

        knobs = tuple(
            KnobSpec(k.name, k.type, from_value(k.default) if k.HasField("default") else None,
                     k.minimum if k.HasField("minimum") else None, k.maximum if k.HasField("maximum") else None,
                     tuple(k.choices), k.description)
            for k in card.knobs
        )
        grid = ({"rule": card.grid.rule, "tokens": card.grid.tokens, "pixels_per_token": card.grid.pixels_per_token}
                if card.HasField("grid") else None)
        return cls(card.id, card.family, f"{card.default_width}x{card.default_height}", card.max_side, card.size_multiple,
                   card.max_prompt_tokens, knobs, dict(card.quality_steps), grid, card.member)


def _number(value: float) -> str:
    """Whole numbers without a fraction; numbers past 2^53 (seed limits, sent as doubles) in short form."""
    if abs(value) >= 2**53:
        return f"{value:.3g}"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
