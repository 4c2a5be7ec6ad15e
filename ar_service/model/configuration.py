"""The AR's configuration, read from the root ``config.json`` of a MammothModa2 checkpoint.

Where each field lives (facts from bytedance/mammothmoda, file
``mammothmoda2/model/mammothmoda2_qwen2_5_vl/configuration_mammothmoda2_qwen2_5_vl.py`` and
``mammothmoda2/model/configuration_mammothmoda2.py``; vllm-omni's copy in
``vllm_omni/model_executor/models/mammoth_moda2/configuration_mammothmoda2.py`` agrees):

- root ``config.json``: ``model_type`` "mammothmoda2", ``llm_config`` (the AR), ``gen_*`` (DiT side), and for
  the Dev variant ``gen_condition_layers`` (default there [-2, -5, -8, -11, -14, -17]; the Preview config class
  has no such field, so its absence means "final normed hidden states").
- ``llm_config`` (model_type ``mammothmoda2_qwen2_5_vl``): ``text_config``, ``vision_config``,
  ``image_token_id`` (default 151655), ``video_token_id`` (default 151656), ``vision_start_token_id`` /
  ``vision_end_token_id`` (passed through as extra keys, 151652 / 151653 in Preview: vllm-omni's
  tests/e2e MammothModa2 test reads all four from ``config.json``'s ``llm_config``), and ``extra_gen_vocab``,
  ``gen_vocab_size`` (32800), ``gen_vocab_start_index``, ``moe_type`` (copied into ``text_config`` when that
  lacks them: the text config wins).
- ``text_config`` (model_type ``mammothmoda2_qwen2_5_vl_text``): the Qwen2.5 decoder dims ``vocab_size``
  (the TEXT vocabulary, 152064; the generation ids live only in ``gen_embed_tokens`` / ``gen_head``),
  ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``hidden_act``, ``max_position_embeddings``, ``rms_norm_eps`` (default 1e-5),
  ``rope_theta`` (default 1e6), ``rope_scaling`` ({"type": "mrope", "mrope_section": [...]}), ``tie_word_embeddings``,
  ``use_sliding_window``; ``gen_vocab_start_index`` defaults to ``vocab_size`` when ``extra_gen_vocab``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

LLM_MODEL_TYPE = "mammothmoda2_qwen2_5_vl"
# Defaults of Mammothmoda2Qwen2_5_VLConfig (configuration_mammothmoda2_qwen2_5_vl.py).
DEFAULT_IMAGE_TOKEN_ID = 151655
DEFAULT_VIDEO_TOKEN_ID = 151656

_MOE_RE = re.compile(r"^(none|attention|ffn|ffn_attention)(?:-(\d+):(\d+))?$")


@dataclass(frozen=True)
class MoeSpec:
    """Parsed ``moe_type``: which expert copies exist and on which layers.

    Semantics of upstream ``moe_enable`` (modeling_mammothmoda2_qwen2_5_vl.py): ``"<kind>-<start>:<end>"``
    enables experts on layers with ``start <= layer_idx < end`` (half open; an end past the last layer simply
    covers the rest); without a range, every layer. ``kind`` "ffn" adds ``gen_mlp``, "attention" adds
    ``self_attn.gen_{q,k,v,o}_proj``, "ffn_attention" both, "none" neither.
    """

    ffn: bool
    attention: bool
    start: int = 0
    end: int | None = None  # None = no upper bound

    def enabled(self, part: str, layer_idx: int) -> bool:
        """``part`` is "ffn" or "attention"; whether that expert copy exists on ``layer_idx``."""
        wanted = self.ffn if part == "ffn" else self.attention if part == "attention" else None
        if wanted is None:
            raise ValueError(f"unknown expert part {part!r}")
        return wanted and self.start <= layer_idx and (self.end is None or layer_idx < self.end)

    def layers(self, num_layers: int, part: str) -> list[int]:
        return [i for i in range(num_layers) if self.enabled(part, i)]


def parse_moe_type(moe_type: str) -> MoeSpec:
    """The one parser of the ``<none|attention|ffn|ffn_attention>[-start:end]`` grammar."""
    match = _MOE_RE.match(moe_type) if isinstance(moe_type, str) else None
    if match is None:
        raise ValueError(f"bad moe_type {moe_type!r}: expected <none|attention|ffn|ffn_attention>[-start:end]")
    kind, start, end = match.groups()
    if start is not None and int(start) >= int(end):
        raise ValueError(f"bad moe_type {moe_type!r}: empty layer range (start must be below end)")
    return MoeSpec(
        ffn=kind in ("ffn", "ffn_attention"),
        attention=kind in ("attention", "ffn_attention"),
        start=0 if start is None else int(start),
        end=None if end is None else int(end),
    )


@dataclass(frozen=True)
class ARConfig:
    """Everything the AR needs from ``config.json``, flattened; build it with ``ar_config_from_dict``."""

    vocab_size: int  # text vocabulary (rows of embed_tokens / lm_head)
    gen_vocab_size: int
    gen_vocab_start_index: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    moe_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    initializer_range: float = 0.02
    # Root config's gen_condition_layers (Dev): indices into the HF hidden-states tuple; None = final norm.
    condition_layers: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.gen_vocab_start_index != self.vocab_size:
            # Logits are [lm_head | gen_head]: logit index == token id only when gen ids follow text ids.
            raise ValueError(
                f"gen_vocab_start_index ({self.gen_vocab_start_index}) must equal the text vocab_size "
                f"({self.vocab_size}) with extra_gen_vocab"
            )
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must divide into attention heads, and heads into kv heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen2.5 uses silu)")
        parse_moe_type(self.moe_type)
        if self.condition_layers is not None:
            if not self.condition_layers:
                raise ValueError("gen_condition_layers must not be empty")
            n = self.num_hidden_layers + 1  # the HF hidden-states tuple: embeddings, N-1 layer outputs, final norm
            bad = [i for i in self.condition_layers if not -n <= i < n]
            if bad:
                raise ValueError(f"gen_condition_layers {bad} lie outside the {n} hidden states of this model")

    @property
    def moe(self) -> MoeSpec:
        return parse_moe_type(self.moe_type)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def total_vocab_size(self) -> int:
        return self.vocab_size + self.gen_vocab_size

    @property
    def vision_placeholder_ids(self) -> tuple[int, ...]:
        """Prompt ids that never condition the DiT (vllm-omni's ``visual_ids``; upstream ``visual_tokens_ids``)."""
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        return tuple(i for i in ids if i is not None)


def ar_config_from_dict(root_config: dict[str, Any]) -> ARConfig:
    """Parse the root ``config.json`` (model_type mammothmoda2) into an ``ARConfig``; clear errors on anything odd."""
    llm = root_config.get("llm_config")
    if not isinstance(llm, dict):
        raise ValueError("config.json has no llm_config object")
    if llm.get("model_type") != LLM_MODEL_TYPE:
        raise ValueError(f"llm_config.model_type is {llm.get('model_type')!r}; expected {LLM_MODEL_TYPE!r}")
    text = dict(llm.get("text_config") or {})
    # Mammothmoda2Qwen2_5_VLConfig copies these four into text_config only when text_config lacks them.
    for key, default in (("extra_gen_vocab", True), ("gen_vocab_size", 32800), ("gen_vocab_start_index", None), ("moe_type", "ffn")):
        text.setdefault(key, llm.get(key, default))
    if not text.get("extra_gen_vocab", True):
        raise ValueError("extra_gen_vocab false (generation ids inside the text vocabulary) is not supported")
    if text.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings is not supported: MammothModa2 keeps lm_head and gen_head separate")
    if text.get("use_sliding_window", False):
        raise ValueError("use_sliding_window is not supported (Qwen2.5-VL-7B uses full attention)")
    rope_theta, rope_type = _rope(text)
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope type {rope_type!r} is not supported (Preview uses mrope == default RoPE for text)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if k not in text]
    if missing:
        raise ValueError(f"llm_config.text_config lacks {missing}")
    vocab = int(text["vocab_size"])
    start = text.get("gen_vocab_start_index")
    layers = root_config.get("gen_condition_layers")
    heads = int(text["num_attention_heads"])
    return ARConfig(
        vocab_size=vocab,
        gen_vocab_size=int(text["gen_vocab_size"]),
        gen_vocab_start_index=vocab if start is None else int(start),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        moe_type=str(text["moe_type"]),
        image_token_id=int(_first(llm, text, "image_token_id", DEFAULT_IMAGE_TOKEN_ID)),
        video_token_id=int(_first(llm, text, "video_token_id", DEFAULT_VIDEO_TOKEN_ID)),
        vision_start_token_id=_optional_int(_first(llm, text, "vision_start_token_id", None)),
        vision_end_token_id=_optional_int(_first(llm, text, "vision_end_token_id", None)),
        hidden_act=str(text.get("hidden_act", "silu")),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        initializer_range=float(text.get("initializer_range", 0.02)),
        condition_layers=None if layers is None else tuple(int(i) for i in layers),
        extra={"llm_config": llm},
    )


def _first(llm: dict, text: dict, key: str, default: Any) -> Any:
    value = llm.get(key)
    return text.get(key, default) if value is None else value


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _rope(text: dict) -> tuple[float, str]:
    """rope_theta and rope type; transformers 5 may save them as ``rope_parameters`` instead."""
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    theta = text.get("rope_theta", params.get("rope_theta", 1000000.0))
    kind = scaling.get("rope_type", scaling.get("type", params.get("rope_type", "default")))
    return float(theta), str(kind)
