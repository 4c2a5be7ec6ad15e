"""Configuration of the MammothModa2-style AR: a Qwen2 decoder plus generation experts and gen vocabulary.

Facts (bytedance/mammothmoda, summarized in REFERENCE.md): the generation vocabulary starts right after
the text vocabulary (152064), has its own embedding and head, and `moe_type` picks which sub-modules get a
generation-expert copy ("ffn", "attention", "ffn_attention", optionally on a layer range "ffn-14:28").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PretrainedConfig

_MOE_RE = re.compile(r"^(none|attention|ffn|ffn_attention)(?:-(\d+):(\d+))?$")


@dataclass(frozen=True)
class MoeSpec:
    """Parsed moe_type: which expert copies exist and on which layers (half-open [start, end))."""

    ffn: bool
    attention: bool
    start: int
    end: int | None  # None = up to the last layer

    def layers(self, num_layers: int) -> range:
        end = num_layers if self.end is None else self.end
        if end > num_layers:
            raise ValueError(f"moe_type layer range ends at {end} but the model has {num_layers} layers")
        return range(self.start, end) if (self.ffn or self.attention) else range(0)


def parse_moe_type(moe_type: str) -> MoeSpec:
    """The one parser of the `<none|attention|ffn|ffn_attention>[-start:end]` grammar."""
    match = _MOE_RE.match(moe_type) if isinstance(moe_type, str) else None
    if match is None:
        raise ValueError(f"bad moe_type {moe_type!r}: expected <none|attention|ffn|ffn_attention>[-start:end]")
    kind, start, end = match.groups()
    if kind == "none" and start is not None:
        raise ValueError(f"bad moe_type {moe_type!r}: 'none' takes no layer range")
    if start is not None and int(start) >= int(end):
        raise ValueError(f"bad moe_type {moe_type!r}: empty layer range")
    return MoeSpec(
        ffn=kind in ("ffn", "ffn_attention"),
        attention=kind in ("attention", "ffn_attention"),
        start=0 if start is None else int(start),
        end=None if end is None else int(end),
    )


class MammothARConfig(PretrainedConfig):
    """Explicit fields (transformers 5 configs are keyword-only dataclasses); defaults are tiny-ish."""

    model_type = "ardit_mammothmoda2_ar"

    vocab_size: int = 512
    gen_vocab_size: int = 72
    gen_vocab_start_index: int | None = None
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    moe_type: str = "ffn"
    pixels_per_token: int = 16
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.gen_vocab_start_index is None:
            self.gen_vocab_start_index = self.vocab_size
        # Logits are [text | gen] concatenated, so logit index == token id only if gen ids follow text ids.
        if self.gen_vocab_start_index != self.vocab_size:
            raise ValueError(
                f"gen_vocab_start_index ({self.gen_vocab_start_index}) must equal vocab_size ({self.vocab_size})"
            )
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must divide into heads, and heads into kv heads")
        if self.pixels_per_token < 1:
            raise ValueError(f"pixels_per_token must be positive, got {self.pixels_per_token}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings is not supported: lm_head and gen_head are separate")
        self.moe_layers  # validate moe_type against num_hidden_layers early
        super().__post_init__(**kwargs)

    @property
    def moe(self) -> MoeSpec:
        return parse_moe_type(self.moe_type)

    @property
    def moe_layers(self) -> range:
        return self.moe.layers(self.num_hidden_layers)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def total_vocab_size(self) -> int:
        return self.vocab_size + self.gen_vocab_size
