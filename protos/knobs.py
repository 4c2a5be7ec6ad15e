"""Per-model knobs: what each model family accepts beyond OpenAI's standard fields.

Which knobs a model takes, their types and ranges are part of the public contract:
ar_service validates every request against them (and publishes them via ListModels),
dit_service validates the denoising ones again for callers that reach Render directly.
Defaults that belong to a checkpoint (AR sampling) are ``None`` here and filled in by the
service from the model's own config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from protos.status import RequestRejected

KnobKind = Literal["float", "int", "string", "float_pair"]
Stage = Literal["request", "ar", "dit"]


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Knob:
    name: str
    kind: KnobKind
    stage: Stage
    description: str
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()

    def range_text(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        low = "" if self.minimum is None else (">" if self.exclusive_minimum else ">=") + f" {_number_text(self.minimum)}"
        high = "" if self.maximum is None else f"<= {_number_text(self.maximum)}"
        return " and ".join(part for part in (low, high) if part) or "any value"

    def check(self, value: Any) -> Any:
        """Returns the value in canonical form, or raises RequestRejected naming this knob."""
        if self.kind == "float_pair":
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                self._reject(value, "must be a list of two numbers [start, end]")
            pair = [self._number(v, integral=False) for v in value]
            if pair[0] > pair[1]:
                self._reject(value, "must be ordered: start <= end")
            return pair
        if self.kind == "string":
            if not isinstance(value, str) or (self.choices and value not in self.choices):
                self._reject(value, f"must be {self.range_text()}")
            return value
        return self._number(value, integral=self.kind == "int")

    def _number(self, value: Any, integral: bool) -> int | float:
        kind = "an integer" if integral else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self._reject(value, f"must be {kind} ({self.range_text()})")
        if isinstance(value, float) and not math.isfinite(value):
            self._reject(value, f"must be a finite number ({self.range_text()})")
        if integral:
            if isinstance(value, float) and not value.is_integer():
                self._reject(value, f"must be an integer ({self.range_text()})")
            value = int(value)
        else:
            value = float(value)
        too_low = self.minimum is not None and (value <= self.minimum if self.exclusive_minimum else value < self.minimum)
        too_high = self.maximum is not None and value > self.maximum
        if too_low or too_high:
            self._reject(value, f"must be {self.range_text()}")
        return value

    def _reject(self, value: Any, why: str) -> None:
        raise RequestRejected(f"'{self.name}' {why}; got {value!r}", param=self.name)


@dataclass(frozen=True)
class KnobTable:
    """The knobs of one model family, and its quality -> steps presets."""

    knobs: tuple[Knob, ...]
    quality_steps: Mapping[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Knob:
        return self.by_name[name]

    @property
    def by_name(self) -> dict[str, Knob]:
        return {knob.name: knob for knob in self.knobs}

    def names(self, stages: Iterable[Stage] | None = None) -> list[str]:
        wanted = set(stages) if stages is not None else None
        return [k.name for k in self.knobs if wanted is None or k.stage in wanted]

    def validate(self, given: Mapping[str, Any], stages: Iterable[Stage] | None = None) -> dict[str, Any]:
        """Checks every given knob (unknown names included) and returns them canonical."""
        accepted = self.names(stages)
        checked = {}
        for name, value in given.items():
            if name not in accepted:
                raise RequestRejected(
                    f"unknown parameter '{name}'; accepted parameters: {', '.join(sorted(accepted))}", param=name
                )
            checked[name] = self.by_name[name].check(value)
        return checked

    def checkpoint_defaults(self, defaults: Mapping[str, Any], stage: Stage) -> dict[str, Any]:
        """The ``stage``'s part of a checkpoint's knob defaults (``ardit_serving.json`` ``knob_defaults``), checked
        like a request's AR and DiT knobs; a wrong name or value is a ValueError that says which (at start-up)."""
        try:
            checked = self.validate(defaults, stages=("ar", "dit"))
        except RequestRejected as exc:
            raise ValueError(f"ardit_serving.json knob_defaults: {exc.message}") from exc
        return {name: value for name, value in checked.items() if self.by_name[name].stage == stage}

    def resolve(self, given: Mapping[str, Any], defaults: Mapping[str, Any], stages: Iterable[Stage]) -> dict[str, Any]:
        """Validated knobs of the given stages with every default filled in (``defaults`` overrides the table's)."""
        checked = self.validate(given, stages)
        resolved = {}
        for name in self.names(stages):
            if name in checked:
                resolved[name] = checked[name]
            elif name in defaults:
                resolved[name] = defaults[name]
            elif self.by_name[name].default is not None:
                resolved[name] = self.by_name[name].default
        return resolved

    def steps_for_quality(self, quality: str) -> int | None:
        """The step preset for an OpenAI ``quality``; None for "" / "auto" (the model default)."""
        if quality in ("", "auto"):
            return None
        if quality not in self.quality_steps:
            raise RequestRejected(
                f"'quality' must be one of auto, {', '.join(self.quality_steps)}; got {quality!r}", param="quality"
            )
        return self.quality_steps[quality]


# MammothModa2. Sources: vllm-omni's MammothModa2 diffusion stage (text_guidance_scale 9.0,
# cfg_range (0, 1), 50 steps), the checkpoint's t2i_generation_config.json (AR sampling) and the released
# generate_t2i (AR guidance, bytedance/mammothmoda qwen25vl modeling_mammothmoda2.py).
MAMMOTHMODA2_KNOBS = KnobTable(
    knobs=(
        Knob("seed", "int", "request", "Seed of image 0; image i uses seed + i. Drawn when absent.",
             minimum=0, maximum=2**63 - 1),
        Knob("num_inference_steps", "int", "dit", "Denoising steps (overrides the quality preset).",
             default=50, minimum=1, maximum=200),
        Knob("text_guidance_scale", "float", "dit", "Classifier-free guidance scale; <= 1 disables guidance.",
             default=9.0, minimum=0.0, maximum=30.0),
        Knob("image_guidance_scale", "float", "dit",
             "Image guidance of an edit (MammothModa2-Dev, reference images): with text guidance > 1 and this > 1 each "
             "guided step runs three branches, uncond + scale * (ref - uncond) + text_guidance_scale * (cond - ref); "
             "<= 1 leaves two-way text guidance. Accepted and without effect for text to image (no reference images).",
             default=2.0, minimum=0.0, maximum=30.0),
        Knob("cfg_range", "float_pair", "dit", "Guidance applies to steps i with start <= i/N <= end.",
             default=[0.0, 1.0], minimum=0.0, maximum=1.0),
        Knob("cfg_execution_mode", "string", "dit",
             "How a guided step runs its two branches: 'sequential' (two transformer calls) or 'packed' (one batch of "
             "two, the shorter condition padded; same result, exactly so on CPU in float32).",
             default="sequential", choices=("sequential", "packed")),
        Knob("dit_cache_threshold", "float", "dit",
             "Step caching: a denoising step whose first-block modulated input changed by less than this (relative "
             "L1, summed since the last computed step) reuses the last computed velocity instead of running the "
             "transformer; 0 = off (every step computed). docs/speed-modes.md has the measured trade-off.",
             default=0.0, minimum=0.0, maximum=1.0),
        Knob("temperature", "float", "ar", "AR sampling temperature; 0 = greedy. Default: the checkpoint's.",
             minimum=0.0, maximum=2.0),
        Knob("top_k", "int", "ar", "AR top-k over the visual tokens. Default: the checkpoint's.",
             minimum=1, maximum=1_000_000),
        Knob("top_p", "float", "ar", "AR nucleus sampling mass. Default: the checkpoint's.",
             minimum=0.0, maximum=1.0, exclusive_minimum=True),
        Knob("ar_decoding", "string", "ar",
             "How many visual tokens an AR forward decides: 'sequential' (one), 'speculative' (lossless: drafts a "
             "window of tokens and keeps those the model itself draws, so the grid is the sequential one for the same "
             "seed in fewer forwards), 'row_parallel' (lossy: each grid row starts once the row above has "
             "ar_decoding_window tokens). docs/speed-modes.md has the measured trade-offs.",
             default="sequential", choices=("sequential", "speculative", "row_parallel")),
        Knob("ar_decoding_window", "int", "ar",
             "Tokens a speculative forward feeds per image (default 8), or the lead of a grid row over the next in "
             "row_parallel decoding (default 4); 0 = the mode's default. Not for sequential decoding.",
             default=0, minimum=0, maximum=64),
        Knob("ar_cfg_scale", "float", "ar",
             "AR classifier-free guidance: each image decodes a second row that sees only the last 10 prompt tokens, "
             "and every draw uses uncond + scale * (cond - uncond) before temperature, top-k and top-p; 1 turns it "
             "off. Default: the checkpoint's t2i_generation_config.json cfg_scale, else 6.0 (the released code's).",
             minimum=1.0, maximum=30.0),
    ),
    # OpenAI's quality values -> num_inference_steps ("auto" keeps the default above).
    quality_steps={"low": 16, "medium": 28, "standard": 28, "high": 50, "hd": 50},
)

FAMILIES = {"mammothmoda2": MAMMOTHMODA2_KNOBS}
