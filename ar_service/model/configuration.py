"""The AR's configuration, read from the root ``config.json`` of a MammothModa2 checkpoint (Preview or Dev).

Where each field lives (facts from bytedance/mammothmoda; Preview on branch ``qwen25vl``:
``mammothmoda2/model/mammothmoda2_qwen2_5_vl/configuration_mammothmoda2_qwen2_5_vl.py`` and
``mammothmoda2/model/configuration_mammothmoda2.py``, vllm-omni's copy in
``vllm_omni/model_executor/models/mammoth_moda2/configuration_mammothmoda2.py`` agrees; Dev on ``main``:
``mamoda2/mammothmoda2/model/mammothmoda2_qwen3_vl/configuration_mammothmoda2_qwen3_vl.py`` ("QC") and
``mamoda2/mammothmoda2/model/configuration_mammothmoda2.py`` ("C")):

- root ``config.json``: ``model_type`` "mammothmoda2", ``llm_config`` (the AR), ``gen_*`` (DiT side), and for
  the Dev member ``gen_condition_layers`` (C:40, C:65: ``gen_condition_layers or [-2, -5, -8, -11, -14, -17]``, so
  an absent or empty list means the default; the Preview config class has no such field, so its absence there
  means "final normed hidden states") and ``gen_text_condition_with_answer`` (read by the Dev T2I code, declared by
  no config class: an extra key of config.json; ardit's default when absent is False).
- ``llm_config.model_type`` names the member: ``mammothmoda2_qwen2_5_vl`` = Preview, ``mammothmoda2_qwen3_vl`` = Dev.
- Preview ``llm_config``: ``text_config``, ``vision_config``, ``image_token_id`` (default 151655),
  ``video_token_id`` (default 151656), ``vision_start_token_id`` / ``vision_end_token_id`` (passed through as extra
  keys, 151652 / 151653 in Preview: vllm-omni's tests/e2e MammothModa2 test reads all four from ``config.json``'s
  ``llm_config``), and ``extra_gen_vocab``, ``gen_vocab_size`` (32800), ``gen_vocab_start_index``, ``moe_type``
  (copied into ``text_config`` when that lacks them: the text config wins).
- Preview ``text_config`` (model_type ``mammothmoda2_qwen2_5_vl_text``): the Qwen2.5 decoder dims ``vocab_size``
  (the TEXT vocabulary, 152064; the generation ids live only in ``gen_embed_tokens`` / ``gen_head``),
  ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``hidden_act``, ``max_position_embeddings``, ``rms_norm_eps`` (default 1e-5),
  ``rope_theta`` (default 1e6), ``rope_scaling`` ({"type": "mrope", "mrope_section": [...]}), ``tie_word_embeddings``,
  ``use_sliding_window``; ``gen_vocab_start_index`` defaults to ``vocab_size`` when ``extra_gen_vocab``. q/k/v
  projections carry a bias, o_proj none; no q/k norms; head_dim = hidden_size / num_attention_heads.
- Dev ``llm_config`` (``Mammothmoda2Qwen3VLConfig``, QC:274-323): image / video / vision start / vision end ids
  default 151655 / 151656 / 151652 / 151653; ``extra_gen_vocab`` True, ``gen_vocab_size`` 32800,
  ``gen_vocab_start_index`` 152064, ``moe_type`` "ffn", copied into ``text_config`` only where it lacks them
  (QC:294-311).
- Dev ``text_config`` (``Mammothmoda2Qwen3VLTextConfig``, model_type ``mammothmoda2_qwen3_vl_text``, QC:172-227),
  every field with the class default when config.json lacks it (``DEV_TEXT_DEFAULTS``): vocab_size 151936,
  hidden 4096, intermediate 22016, 32 layers, 32 heads, 32 kv heads, an explicit ``head_dim`` 128 (q_proj's output
  is heads * head_dim, which need not equal hidden), silu, max positions 128000, rms eps 1e-6, rope_theta 5e6,
  ``rope_scaling`` None (which the released rotary embedding cannot run: it calls ``rope_scaling.get`` (QM:306), so
  ardit requires a dict), ``attention_bias`` False (q, k, v AND o projections, QM:480-491), per-head q/k RMSNorm
  always. ``gen_vocab_start_index`` is a fixed 152064 there, independent of ``vocab_size``.

The token-id / logit-column / embedding-row mapping (one place: ``ARConfig.gen_logit_start``,
``gen_vocab_start_index``, ``gen_id_range``, ``gen_embedding_row``): logits are ``[lm_head (vocab_size) |
gen_head (gen_vocab_size)]`` and the released sampler uses the sampled LOGIT INDEX as the token id (Dev
``modeling_mammothmoda2.py:347-362``), so gen_head column c is token id ``vocab_size + c`` (``gen_logit_start``).
Routing and the generation embedding use the id: ``id >= gen_vocab_start_index`` is a generation token, embedded
as ``gen_embed_tokens[id - gen_vocab_start_index]`` (QM:917-927). Preview has ``vocab_size ==
gen_vocab_start_index`` so the two agree; a Dev config.json with upstream Qwen3-VL's ``vocab_size`` 151936 has a
128-id skew (column c is embedded as gen row c - 128), which ardit reproduces as released.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PREVIEW_LLM_MODEL_TYPE = "mammothmoda2_qwen2_5_vl"
DEV_LLM_MODEL_TYPE = "mammothmoda2_qwen3_vl"
DEV_TEXT_MODEL_TYPE = "mammothmoda2_qwen3_vl_text"
LLM_MODEL_TYPE = PREVIEW_LLM_MODEL_TYPE  # the Preview AR's llm_config.model_type
#: ``llm_config.model_type`` -> ``ARConfig.member``.
MEMBER_BY_LLM_MODEL_TYPE = {PREVIEW_LLM_MODEL_TYPE: "preview", DEV_LLM_MODEL_TYPE: "dev"}
MEMBERS = tuple(MEMBER_BY_LLM_MODEL_TYPE.values())

# Defaults of Mammothmoda2Qwen2_5_VLConfig (configuration_mammothmoda2_qwen2_5_vl.py).
DEFAULT_IMAGE_TOKEN_ID = 151655
DEFAULT_VIDEO_TOKEN_ID = 151656

# Dev: Mammothmoda2Qwen3VLTextConfig's constructor defaults (QC:172-195).
DEV_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 5000000.0,
    "attention_bias": False,
}
# Dev: Mammothmoda2Qwen3VLConfig's generation fields (QC:283-286), copied into text_config where it lacks them.
DEV_GEN_DEFAULTS: dict[str, Any] = {"extra_gen_vocab": True, "gen_vocab_size": 32800, "gen_vocab_start_index": 152064,
                                    "moe_type": "ffn"}
# Dev: Mammothmoda2Qwen3VLConfig's token ids (QC:278-281).
DEV_TOKEN_ID_DEFAULTS: dict[str, int] = {"image_token_id": 151655, "video_token_id": 151656,
                                         "vision_start_token_id": 151652, "vision_end_token_id": 151653}
#: Dev root config's ``gen_condition_layers`` when config.json lacks it or gives an empty list (C:65).
DEV_DEFAULT_CONDITION_LAYERS = (-2, -5, -8, -11, -14, -17)
#: Dev's rotary embedding when ``rope_scaling`` has no ``mrope_section`` (QM:306).
DEV_DEFAULT_MROPE_SECTION = (24, 20, 20)

_MOE_RE = re.compile(r"^(none|attention|ffn|ffn_attention)(?:-(\d+):(\d+))?$")


@dataclass(frozen=True)
class MoeSpec:
    """Parsed ``moe_type``: which expert copies exist and on which layers.

    Semantics of upstream ``moe_enable`` (modeling_mammothmoda2_qwen2_5_vl.py): ``"<kind>-<start>:<end>"``
    enables experts on layers with ``start <= layer_idx < end`` (half open; an end past the last layer simply
    covers the rest); without a range, every layer. ``kind`` "ffn" adds ``gen_mlp``, "attention" adds
    ``self_attn.gen_{q,k,v,o}_proj``, "ffn_attention" both, "none" neither. The Dev member builds FFN experts only
    (``ARConfig.moe`` drops the attention part there).
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
    """Everything the AR needs from ``config.json``, flattened; build it with ``ar_config_from_dict``.

    The fields after ``vision_end_token_id`` default to Preview's architecture, so a Preview config reads as before.
    """

    vocab_size: int  # text vocabulary (rows of embed_tokens / lm_head)
    gen_vocab_size: int
    gen_vocab_start_index: int  # routing / gen-embedding boundary of token ids (see gen_logit_start for logits)
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
    # Root config's gen_condition_layers: indices into the HF hidden-states tuple (``condition_tuple_indices``);
    # None = the final-normed states (Preview without the field).
    condition_layers: tuple[int, ...] | None = None
    #: "preview" (Qwen2.5-VL AR) or "dev" (Qwen3-VL AR), from llm_config.model_type.
    member: str = "preview"
    #: Bias on q/k/v_proj (Preview's Qwen2.5: always; Dev: text_config.attention_bias, default False). o_proj's
    #: bias is ``o_proj_bias``.
    attention_bias: bool = True
    #: Per-head RMSNorm on q and k (weight [head_dim], eps rms_norm_eps) after the view to heads, before RoPE (Dev).
    qk_norm: bool = False
    #: text_config.head_dim when the member has one (Dev); None = hidden_size // num_attention_heads (Preview).
    explicit_head_dim: int | None = None
    #: rope_scaling's mrope_section (T, H, W shares of head_dim / 2), when the config gives one (Dev: always).
    mrope_section: tuple[int, ...] | None = None
    #: The member's MRoPE layout: interleaved (Dev's ``apply_interleaved_mrope``, QM:308-325, whatever config.json's
    #: ``mrope_interleaved`` says) or chunked (Preview). Text-only positions make both plain 1-D RoPE.
    mrope_interleaved: bool = False
    #: Whether entry N (the last) of the HF hidden-states tuple is the final-normed state (Preview: transformers'
    #: Qwen2.5 text model appends ``norm(x)``) or layer N-1's raw output (Dev: ``check_model_inputs`` records each
    #: decoder layer's output and the CausalLM output has no ``last_hidden_state`` to put in its place).
    final_hidden_normed: bool = True
    #: Root config's ``gen_text_condition_with_answer`` (Dev T2I code, ``t2i_utils.py:118``): whether the DiT's text
    #: condition also takes the text tokens of the answer part (the assistant header and the grid digits) rather
    #: than only the question's; False when absent (the released code would fail on an absent key).
    text_condition_with_answer: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.member not in MEMBERS:
            raise ValueError(f"member must be one of {MEMBERS}; got {self.member!r}")
        if self.member == "preview" and self.gen_vocab_start_index != self.vocab_size:
            # Preview's config class derives the start from vocab_size; a Preview config that says otherwise is
            # not a released layout.
            raise ValueError(
                f"gen_vocab_start_index ({self.gen_vocab_start_index}) must equal the text vocab_size "
                f"({self.vocab_size}) with extra_gen_vocab"
            )
        if not self.gen_id_range:
            raise ValueError(
                f"no token id is both a gen_head column (from vocab_size {self.vocab_size}) and a gen embedding row "
                f"(from gen_vocab_start_index {self.gen_vocab_start_index}), {self.gen_vocab_size} of each"
            )
        if self.explicit_head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must divide into attention heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE; got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen2.5 / Qwen3 use silu)")
        parse_moe_type(self.moe_type)
        if self.member == "dev" and self.mrope_section is None:
            raise ValueError("the Dev AR needs rope_scaling's mrope_section (its rotary embedding reads it)")
        if self.mrope_section is not None:
            _check_mrope_section(self.mrope_section, self.head_dim, self.mrope_interleaved)
        if self.condition_layers is not None:
            if not self.condition_layers:
                raise ValueError("gen_condition_layers must not be empty")
            n = self.num_hidden_layers + 1  # the HF hidden-states tuple: embeddings, then one entry per layer
            bad = [i for i in self.condition_layers if not -n <= i < n]
            if bad:
                raise ValueError(f"gen_condition_layers {bad} lie outside the {n} hidden states of this model")

    @property
    def moe(self) -> MoeSpec:
        """The experts this member builds: Dev calls ``moe_enable`` for "ffn" alone (QM:567), so an "attention"
        part of its moe_type builds nothing (``ar_config_from_dict`` logs a warning)."""
        spec = parse_moe_type(self.moe_type)
        return dataclasses.replace(spec, attention=False) if self.member == "dev" else spec

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.explicit_head_dim is None else self.explicit_head_dim

    @property
    def o_proj_bias(self) -> bool:
        """Bias on o_proj: Dev's ``attention_bias`` covers all four projections (QM:489-491); Preview's o_proj has none."""
        return self.member == "dev" and self.attention_bias

    @property
    def total_vocab_size(self) -> int:
        """Logit columns: ``[lm_head | gen_head]``; every sampled column index is a token id."""
        return self.vocab_size + self.gen_vocab_size

    @property
    def gen_logit_start(self) -> int:
        """Token id of gen_head's column 0: the sampled logit index is the token id (released sampler), so gen_head
        column c is id ``gen_logit_start + c``. Everything that turns gen logit columns into ids uses this, never
        ``gen_vocab_start_index`` (which is where routing and the gen embedding start; they differ by the skew)."""
        return self.vocab_size

    @property
    def gen_id_range(self) -> range:
        """Ids that are both a gen_head column (a decode step can sample them) and generation tokens with an embedding
        row (``gen_vocab_start_index <= id < gen_vocab_start_index + gen_vocab_size``): what a decode step may emit."""
        low = max(self.gen_logit_start, self.gen_vocab_start_index)
        return range(low, min(self.gen_logit_start, self.gen_vocab_start_index) + self.gen_vocab_size)

    def gen_embedding_row(self, token_id: Any) -> Any:
        """Row of ``gen_embed_tokens`` for generation token id(s) (an int or a tensor): ``id - gen_vocab_start_index``."""
        return token_id - self.gen_vocab_start_index

    def gen_column_id(self, column: Any) -> Any:
        """Token id(s) of gen_head column(s) (an int or a tensor): ``gen_logit_start + column``."""
        return column + self.gen_logit_start

    @property
    def condition_tuple_indices(self) -> tuple[int, ...] | None:
        """``condition_layers`` as non-negative indices into the N + 1 entry hidden-states tuple: entry 0 is the
        embeddings, entry k (1 <= k <= N) the output of decoder layer k - 1 (the input of layer k for k < N); entry N
        is normed only when ``final_hidden_normed``. So Dev's default list at N = 36 reads the outputs of layers
        34, 31, 28, 25, 22, 19 (entries 35, 32, ..., 20)."""
        if self.condition_layers is None:
            return None
        return tuple(i % (self.num_hidden_layers + 1) for i in self.condition_layers)

    @property
    def vision_placeholder_ids(self) -> tuple[int, ...]:
        """Prompt ids that never condition the DiT (vllm-omni's ``visual_ids``; upstream ``visual_tokens_ids``)."""
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        return tuple(i for i in ids if i is not None)


def _check_mrope_section(section: tuple[int, ...], head_dim: int, interleaved: bool) -> None:
    """Sections share head_dim / 2 rotary frequencies among T, H, W. Interleaved (Qwen3-VL): H takes indices 1, 4, ...
    below 3 * section[1], W 2, 5, ... below 3 * section[2], T the rest; both bounds must lie within head_dim / 2."""
    half = head_dim // 2
    if len(section) != 3 or any(s < 0 for s in section) or sum(section) != half:
        raise ValueError(f"rope_scaling mrope_section {list(section)} must be 3 non-negative numbers summing to "
                         f"head_dim / 2 = {half}")
    if interleaved and (3 * section[1] > half or 3 * section[2] > half):
        raise ValueError(f"rope_scaling mrope_section {list(section)}: interleaved MRoPE needs 3 * section[1] and "
                         f"3 * section[2] <= head_dim / 2 = {half}")


def ar_config_from_dict(root_config: dict[str, Any]) -> ARConfig:
    """Parse the root ``config.json`` (model_type mammothmoda2) into an ``ARConfig``; clear errors on anything odd."""
    llm = root_config.get("llm_config")
    if not isinstance(llm, dict):
        raise ValueError("config.json has no llm_config object")
    member = MEMBER_BY_LLM_MODEL_TYPE.get(str(llm.get("model_type")))
    if member is None:
        known = " or ".join(repr(t) for t in MEMBER_BY_LLM_MODEL_TYPE)
        raise ValueError(f"llm_config.model_type is {llm.get('model_type')!r}; expected {known}")
    fields = _dev_fields(llm) if member == "dev" else _preview_fields(llm)
    layers = root_config.get("gen_condition_layers")
    if member == "dev":
        layers = layers or list(DEV_DEFAULT_CONDITION_LAYERS)  # C:65 uses ``or``: absent and [] both mean the default
    with_answer = root_config.get("gen_text_condition_with_answer", False)
    if not isinstance(with_answer, bool):
        raise ValueError(f"gen_text_condition_with_answer must be true or false; got {with_answer!r}")
    return ARConfig(
        **fields,
        member=member,
        condition_layers=None if layers is None else tuple(int(i) for i in layers),
        text_condition_with_answer=with_answer,
        extra={"llm_config": llm},
    )


def _common_checks(text: dict) -> None:
    if not text.get("extra_gen_vocab", True):
        raise ValueError("extra_gen_vocab false (generation ids inside the text vocabulary) is not supported")
    if text.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings is not supported: MammothModa2 keeps lm_head and gen_head separate")
    if text.get("use_sliding_window", False):
        raise ValueError("use_sliding_window is not supported (the MammothModa2 ARs use full attention)")


def _preview_fields(llm: dict) -> dict[str, Any]:
    text = dict(llm.get("text_config") or {})
    # Mammothmoda2Qwen2_5_VLConfig copies these four into text_config only when text_config lacks them.
    for key, default in (("extra_gen_vocab", True), ("gen_vocab_size", 32800), ("gen_vocab_start_index", None), ("moe_type", "ffn")):
        text.setdefault(key, llm.get(key, default))
    _common_checks(text)
    rope_theta, rope_type = _rope(text)
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope type {rope_type!r} is not supported (Preview uses mrope == default RoPE for text)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if k not in text]
    if missing:
        raise ValueError(f"llm_config.text_config lacks {missing}")
    vocab = int(text["vocab_size"])
    start = text.get("gen_vocab_start_index")
    heads = int(text["num_attention_heads"])
    section = (text.get("rope_scaling") or text.get("rope_parameters") or {}).get("mrope_section")
    return dict(
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
        attention_bias=True,
        qk_norm=False,
        mrope_section=None if section is None else tuple(int(s) for s in section),
        mrope_interleaved=False,
        final_hidden_normed=True,
    )


def _dev_fields(llm: dict) -> dict[str, Any]:
    """Dev: every field from config.json, the released config classes' defaults where it is silent."""
    text = dict(llm.get("text_config") or {})
    if text.get("model_type", DEV_TEXT_MODEL_TYPE) != DEV_TEXT_MODEL_TYPE:
        log.warning("llm_config.text_config.model_type is %r; reading it as %r", text["model_type"], DEV_TEXT_MODEL_TYPE)
    for key, default in DEV_GEN_DEFAULTS.items():  # QC:294-305: the llm_config value, only where text_config lacks it
        text.setdefault(key, llm.get(key, default))
    rope_theta, rope_type, section, interleaved = _dev_rope(text)
    text = {**DEV_TEXT_DEFAULTS, **text}
    _common_checks(text)
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope type {rope_type!r} is not supported (Qwen3-VL's text positions use the default RoPE)")
    heads = int(text["num_attention_heads"])
    moe_type = str(text["moe_type"])
    if parse_moe_type(moe_type).attention:
        log.warning("moe_type %r asks for attention experts; the Dev AR builds FFN experts only (the released code checks "
                    "moe_type for 'ffn' alone), so none are built", moe_type)
    vocab, start = int(text["vocab_size"]), int(text["gen_vocab_start_index"])
    if vocab != start:
        log.info("Dev AR: text vocab_size %d != gen_vocab_start_index %d; gen_head column c is token id %d + c and "
                 "embeds as gen row (id - %d), as released", vocab, start, vocab, start)
    return dict(
        vocab_size=vocab,
        gen_vocab_size=int(text["gen_vocab_size"]),
        gen_vocab_start_index=start,
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        max_position_embeddings=int(text["max_position_embeddings"]),
        moe_type=moe_type,
        image_token_id=int(_first(llm, text, "image_token_id", DEV_TOKEN_ID_DEFAULTS["image_token_id"])),
        video_token_id=int(_first(llm, text, "video_token_id", DEV_TOKEN_ID_DEFAULTS["video_token_id"])),
        vision_start_token_id=int(_first(llm, text, "vision_start_token_id", DEV_TOKEN_ID_DEFAULTS["vision_start_token_id"])),
        vision_end_token_id=int(_first(llm, text, "vision_end_token_id", DEV_TOKEN_ID_DEFAULTS["vision_end_token_id"])),
        hidden_act=str(text["hidden_act"]),
        rms_norm_eps=float(text["rms_norm_eps"]),
        rope_theta=rope_theta,
        initializer_range=float(text["initializer_range"]),
        attention_bias=_bool(text, "attention_bias"),
        qk_norm=True,
        explicit_head_dim=int(text["head_dim"]),
        mrope_section=section,
        mrope_interleaved=interleaved,
        final_hidden_normed=False,
    )


def _bool(text: dict, key: str) -> bool:
    value = text[key]
    if not isinstance(value, bool):
        raise ValueError(f"llm_config.text_config.{key} must be true or false; got {value!r}")
    return value


def _dev_rope(text: dict) -> tuple[float, str, tuple[int, ...], bool]:
    """Dev's rotary embedding (QM:290-306): inv_freq from ``rope_theta`` and head_dim (``rope_type`` default), and
    ``rope_scaling.get("mrope_section", [24, 20, 20])``, so ``rope_scaling`` must be a dict (transformers 5 writes it
    as ``rope_parameters``). Its forward always interleaves (QM:338), so ``mrope_interleaved`` is informative only.

    With T, H and W positions all equal, as for text, generation tokens and MammothTok tokens (no understanding images
    in text-to-image), every frequency index gets the same position whichever axis it is taken from, so interleaved
    (and chunked) MRoPE reduce to plain 1-D RoPE with the same inv_freq: that is what ardit computes.
    """
    scaling, params = text.get("rope_scaling"), text.get("rope_parameters")
    rope = scaling if scaling is not None else params
    if not isinstance(rope, dict):
        raise ValueError("llm_config.text_config.rope_scaling must be a dict with mrope_section (the Dev AR's rotary "
                         f"embedding reads rope_scaling['mrope_section']); got {rope!r}")
    theta = text.get("rope_theta", rope.get("rope_theta", DEV_TEXT_DEFAULTS["rope_theta"]))
    kind = rope.get("rope_type", rope.get("type", "default"))
    section = rope.get("mrope_section", list(DEV_DEFAULT_MROPE_SECTION))
    if not isinstance(section, list | tuple) or not all(isinstance(s, int) for s in section):
        raise ValueError(f"rope_scaling mrope_section must be a list of 3 integers; got {section!r}")
    if rope.get("mrope_interleaved") is False:
        log.warning("rope_scaling says mrope_interleaved false; the released Dev rotary embedding interleaves regardless "
                    "(and text positions make the layout irrelevant)")
    return float(theta), str(kind), tuple(section), True


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
