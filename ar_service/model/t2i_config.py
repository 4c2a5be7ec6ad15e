"""``t2i_generation_config.json``: the AR's sampling defaults and the only source of EOL / visual token ids.

What the file is (bytedance/mammothmoda ``mammothmoda2/model/modeling_mammothmoda2.py``): a transformers
``GenerationConfig`` saved under another name (``GenerationConfig.from_pretrained(root,
config_file_name="t2i_generation_config.json")``) with three extra attributes, ``eol_token_id``,
``visual_token_start_id`` and ``visual_token_end_id``, besides the usual ``do_sample``, ``temperature``,
``top_k``, ``top_p``, ``repetition_penalty``. ardit parses the JSON itself (plain keys, transformers'
GenerationConfig defaults for the absent ones) so no transformers version drift can change a default.

``visual_token_end_id`` is an EXCLUSIVE absolute id:
- Preview's file holds start 152072 and end 168456 (vllm-omni ``tests/e2e/.../test_mammothmoda2*.py``
  constants; bytedance/mammothmoda ``tests/test_visual_token_scope.py`` fixture); 168456 - 152072 = 16384 = 2**14,
  one visual codebook.
- Upstream's ``SampledScopeLogitsProcessor`` (``mammothmoda2/utils/logits_processor.py``) keeps
  ``scores[:, scope_start:scope_end]`` (``scores[:, scope_end:] = -inf``): exclusive end. vllm-omni's
  ``_apply_t2i_token_constraints`` does the same (``row[visual_end:] = -inf``).
- ``generate_t2i`` on the qwen25vl branch computed ``scope_end = scope_start + visual_token_end_id`` (320528, past
  the vocabulary, so the scope silently reached every id >= 152072); upstream's ``tests/test_visual_token_scope.py``
  pins the fix, ``scope_end == visual_token_end_id`` (168456). ardit follows the fix and vllm-omni:
  visual ids are ``[visual_token_start_id, visual_token_end_id)``; ``with_released_scope`` gives the released range
  for those who need bit-parity with that code (``ServingDefaults.visual_token_scope``).

AR guidance: the released ``generate_t2i`` takes ``cfg_scale`` as an argument (default 6.0; its README passes 7.0),
not from this file. ardit reads an optional ``cfg_scale`` key here as the ``ar_cfg_scale`` knob's default, and uses
the released 6.0 when the file has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

T2I_CONFIG_NAME = "t2i_generation_config.json"
#: ``generate_t2i(cfg_scale=6.0)``: bytedance/mammothmoda qwen25vl ``mammothmoda2/model/modeling_mammothmoda2.py`` line 247.
RELEASED_AR_CFG_SCALE = 6.0


@dataclass(frozen=True)
class T2IGenerationConfig:
    eol_token_id: int
    visual_token_start_id: int
    visual_token_end_id: int  # exclusive
    temperature: float = 1.0
    top_k: int = 50  # transformers GenerationConfig default when the file has none
    top_p: float = 1.0
    do_sample: bool = False  # GenerationConfig default; upstream takes the argmax when it is false
    repetition_penalty: float = 1.0
    cfg_scale: float | None = None  # AR guidance; None: absent from the file (RELEASED_AR_CFG_SCALE applies)

    def __post_init__(self) -> None:
        if self.visual_token_start_id >= self.visual_token_end_id:
            raise ValueError("visual_token_end_id (exclusive) must exceed visual_token_start_id")
        if self.visual_token_start_id <= self.eol_token_id < self.visual_token_end_id:
            raise ValueError("eol_token_id must lie outside the visual token range")

    @property
    def num_visual_tokens(self) -> int:
        return self.visual_token_end_id - self.visual_token_start_id

    @property
    def visual_range(self) -> tuple[int, int]:
        """Inclusive (first, last) visual id, the form of a sampling range."""
        return self.visual_token_start_id, self.visual_token_end_id - 1

    @property
    def default_temperature(self) -> float:
        """The AR temperature knob's default: 0 (greedy) when the file says do_sample false, as upstream does."""
        return self.temperature if self.do_sample else 0.0

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """Defaults of the AR's knobs (temperature, top_k, top_p, ar_cfg_scale) from this file."""
        guidance = RELEASED_AR_CFG_SCALE if self.cfg_scale is None else self.cfg_scale
        return {"temperature": self.default_temperature, "top_k": self.top_k, "top_p": self.top_p,
                "ar_cfg_scale": guidance}

    def with_released_scope(self, vocab_end: int) -> T2IGenerationConfig:
        """This config with the visual range the released qwen25vl ``generate_t2i`` samples from
        (``modeling_mammothmoda2.py`` line 252: ``scope_end = scope_start + visual_token_end_id``), cut at the end of
        the vocabulary (``vocab_end``, exclusive): for Preview every id from 152072 on."""
        end = min(self.visual_token_start_id + self.visual_token_end_id, vocab_end)
        return replace(self, visual_token_end_id=end)

    @classmethod
    def from_dict(cls, data: dict) -> T2IGenerationConfig:
        missing = [k for k in ("eol_token_id", "visual_token_start_id", "visual_token_end_id") if data.get(k) is None]
        if missing:
            raise ValueError(f"{T2I_CONFIG_NAME} lacks {missing}")

        def pick(key, kind, default):
            value = data.get(key)
            return default if value is None else kind(value)

        return cls(
            eol_token_id=int(data["eol_token_id"]),
            visual_token_start_id=int(data["visual_token_start_id"]),
            visual_token_end_id=int(data["visual_token_end_id"]),
            temperature=pick("temperature", float, 1.0),
            top_k=pick("top_k", int, 50),
            top_p=pick("top_p", float, 1.0),
            do_sample=pick("do_sample", bool, False),
            repetition_penalty=pick("repetition_penalty", float, 1.0),
            cfg_scale=pick("cfg_scale", float, None),
        )

    @classmethod
    def load(cls, directory: str | Path) -> T2IGenerationConfig:
        path = Path(directory) / T2I_CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"missing {path}")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict:
        """The file as upstream writes it (GenerationConfig keys plus the three token ids; ``cfg_scale`` when set)."""
        return ({} if self.cfg_scale is None else {"cfg_scale": self.cfg_scale}) | {
            "do_sample": self.do_sample,
            "eol_token_id": self.eol_token_id,
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "visual_token_end_id": self.visual_token_end_id,
            "visual_token_start_id": self.visual_token_start_id,
        }

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / T2I_CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
