"""The AR parts of the tiny and the Preview-shaped MammothModa2 checkpoints, in the upstream layout.

The tiny model (tests, CI, ``make up``) is the real layout at toy size: ``llm_config`` with upstream field names,
tensors under ``llm_model.`` (a stub vision tower included, so the loader's skip path is exercised), tokenizer files
and ``t2i_generation_config.json`` at the root. ``tools/make_tiny.py`` assembles the root from these parts and
the DiT engineer's ``gen_*`` parts; ``write_ar_only_root`` builds a root with only the AR (for tests).

The Preview shapes (``preview_llm_config``) are Qwen2.5-VL-7B's text dims (hidden 3584, 28 layers, 28 / 4 heads,
FFN 18944, text vocab 152064, RMSNorm eps 1e-6, rope_theta 1e6, mrope_section [16, 24, 24]) plus the generation
vocabulary (32800 ids from 152064; bytedance/mammothmoda configuration defaults) and FFN experts on layers 14..27:
``moe_type`` "ffn-14:28", as vllm-omni's ``Mammoth2DecoderLayer`` builds ``gen_mlp`` only for ``14 <= layer_idx < 28``
(``vllm_omni/model_executor/models/mammoth_moda2/mammoth_moda2_ar.py``).

The tiny Dev AR (``tiny_dev_llm_parts``) is the Dev layout (Qwen3-VL text decoder: explicit head_dim, no attention
biases, per-head q/k norms, interleaved-MRoPE ``rope_scaling``, FFN experts) at the tiny size, over the same tiny
tokenizer, plus stub Qwen3-VL vision tensors that the AR loader must skip and a real tiny MammothTok (random weights,
``gen_tokenizer.image_tokenizer.*``, sizes in the root config's ``gen_tokenizer_config``) for editing. The Dev
shapes (``dev_llm_config``) are Qwen3-VL-8B's text dims for the GPU benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from ar_service.model.configuration import (
    DEV_LLM_MODEL_TYPE,
    DEV_TEXT_MODEL_TYPE,
    LLM_MODEL_TYPE,
    ar_config_from_dict,
)
from ar_service.model.loading import LLM_PREFIX, build_random_ar
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tokenizer import (
    EOL_TOKEN,
    GEN_RESERVED_SLOTS,
    GEN_VOCAB_SIZE,
    NUM_VISUAL_TOKENS,
    TEXT_VOCAB_SIZE,
    build_preview_tokenizer,
    build_tokenizer,
)

TINY_HIDDEN_SIZE = 64
TINY_MOE_TYPE = "ffn-1:2"  # experts on layer 1 only: exercises the layer-range grammar
#: The tiny model's grid rule (keys of its ardit_serving.json): one visual token per 16x16 pixels, vllm-omni's rule,
#: whose small grids at small sizes keep CPU requests fast. tools.make_tiny and ``write_ar_only_root`` write it; the
#: Preview shapes get the released default (about 1,024 tokens: 32x32 for a square).
TINY_GRID: dict[str, Any] = {"grid_rule": "pixels_per_token", "pixels_per_token": 16}

# Qwen2.5 special ids (vllm-omni MammothModa2 tests; the MammothU tokenizer layout).
PREVIEW_IMAGE_TOKEN_ID = 151655
PREVIEW_VIDEO_TOKEN_ID = 151656
PREVIEW_VISION_START_TOKEN_ID = 151652
PREVIEW_VISION_END_TOKEN_ID = 151653
PREVIEW_TEXT_VOCAB = 152064
PREVIEW_GEN_VOCAB = 32800
# t2i_generation_config.json of Preview (vllm-omni: eol 152064, visual 152072 .. 168456 exclusive, top_k 2048).
PREVIEW_T2I = T2IGenerationConfig(
    eol_token_id=152064,
    visual_token_start_id=152072,
    visual_token_end_id=168456,
    temperature=1.0,
    top_k=2048,
    top_p=1.0,
    do_sample=True,
)


def _llm_config(text: dict, ids: dict, vision: dict, dev: bool = False) -> dict:
    gen = {k: text[k] for k in ("extra_gen_vocab", "gen_vocab_size", "gen_vocab_start_index", "moe_type")}
    llm_type = DEV_LLM_MODEL_TYPE if dev else LLM_MODEL_TYPE
    architecture = "Mammothmoda2Qwen3VLForConditionalGeneration" if dev else "Mammothmoda2Qwen2_5_VLForConditionalGeneration"
    return {
        "model_type": llm_type,
        "architectures": [architecture],
        **ids,
        **gen,
        "text_config": {"model_type": DEV_TEXT_MODEL_TYPE if dev else "mammothmoda2_qwen2_5_vl_text", **text},
        "vision_config": {"model_type": llm_type, **vision},
    }


def _tiny_token_ids() -> dict:
    ids = build_tokenizer().convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }


def tiny_llm_config() -> dict:
    text = {
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": TINY_HIDDEN_SIZE,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2 = 8
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "extra_gen_vocab": True,
        "gen_vocab_size": GEN_VOCAB_SIZE,
        "gen_vocab_start_index": TEXT_VOCAB_SIZE,
        "moe_type": TINY_MOE_TYPE,
    }
    token_ids = _tiny_token_ids()
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_channels": 3,
              "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": TINY_HIDDEN_SIZE}
    return _llm_config(text, token_ids, vision)


def _stub_vision_tensors(vision: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A few vision-tower tensors in Qwen2.5-VL's names: present in a real checkpoint, skipped by the AR loader."""
    h, p, t = vision["hidden_size"], vision["patch_size"], vision["temporal_patch_size"]
    shapes = {
        "patch_embed.proj.weight": (h, vision["in_channels"], t, p, p),
        "blocks.0.norm1.weight": (h,),
        "blocks.0.attn.qkv.weight": (3 * h, h),
        "blocks.0.attn.qkv.bias": (3 * h,),
        "merger.ln_q.weight": (h,),
    }
    return {f"{LLM_PREFIX}model.visual.{k}": torch.randn(s, generator=generator) * 0.02 for k, s in shapes.items()}


def tiny_llm_parts() -> tuple[dict, dict[str, torch.Tensor]]:
    """(llm_config for config.json, tensors with full ``llm_model.`` keys); same values on every call.

    Biases and norm weights get small random offsets (upstream init would zero / one them) so that a
    mis-mapped bias or norm changes the outputs and the strict-loading tests notice.
    """
    llm_config = tiny_llm_config()
    config = ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": llm_config})
    model = build_random_ar(config, "cpu", torch.float32, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    tensors = {f"{LLM_PREFIX}{k}": v.detach().clone() for k, v in model.state_dict().items()}
    tensors.update(_stub_vision_tensors(llm_config["vision_config"], generator))
    return llm_config, tensors


#: The tiny Dev AR: 4 layers, FFN experts on layers 2 and 3 (Dev's experts sit on the upper layers).
TINY_DEV_MOE_TYPE = "ffn-2:4"
#: gen_condition_layers for the tiny Dev root config (Dev's default list needs 17+ layers): entries of its 5-entry
#: hidden-states tuple: -1 = the last layer's output before the final norm (Dev's tuple does not norm it, so every path
#: that builds a condition is checked on that), -2 = layer 2's output (the released default's first entry), -5 = the
#: embeddings.
TINY_DEV_CONDITION_LAYERS = (-1, -2, -5)


def tiny_dev_llm_config() -> dict:
    """The tiny Dev AR as config.json's ``llm_config`` (``mammothmoda2_qwen3_vl``); the root config must carry
    ``gen_condition_layers`` (``TINY_DEV_CONDITION_LAYERS``)."""
    text = {
        "vocab_size": TEXT_VOCAB_SIZE,
        "hidden_size": TINY_HIDDEN_SIZE,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        # room for a 1024x1024 input at the released 73x73 codes beside a prompt and a grid (edit_image_positions)
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        # head_dim / 2 = 8 frequencies: T 4, H 2 (indices 1, 4), W 2 (indices 2, 5), as Qwen3-VL-8B's [24, 20, 20] of 64.
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "extra_gen_vocab": True,
        "gen_vocab_size": GEN_VOCAB_SIZE,
        "gen_vocab_start_index": TEXT_VOCAB_SIZE,
        "moe_type": TINY_DEV_MOE_TYPE,
    }
    vision = {"depth": 1, "hidden_size": 16, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 32, "num_heads": 2,
              "in_channels": 3, "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "out_hidden_size": TINY_HIDDEN_SIZE, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
    return _llm_config(text, _tiny_token_ids(), vision, dev=True)


def _stub_dev_vision_tensors(vision: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A few Qwen3-VL vision-tower tensors (DeepStack merger included): present in a Dev checkpoint, skipped by the AR
    loader."""
    h, p, t = vision["hidden_size"], vision["patch_size"], vision["temporal_patch_size"]
    merged = h * vision["spatial_merge_size"] ** 2
    shapes = {
        "patch_embed.proj.weight": (h, vision["in_channels"], t, p, p),
        "patch_embed.proj.bias": (h,),
        "pos_embed.weight": (vision["num_position_embeddings"], h),
        "blocks.0.norm1.weight": (h,),
        "blocks.0.attn.qkv.weight": (3 * h, h),
        "merger.norm.weight": (h,),
        "deepstack_merger_list.0.norm.weight": (merged,),
        "deepstack_merger_list.0.linear_fc1.weight": (merged, merged),
    }
    return {f"{LLM_PREFIX}model.visual.{k}": torch.randn(s, generator=generator) * 0.02 for k, s in shapes.items()}


#: The tiny Dev model's MammothTok (root config ``gen_tokenizer_config``): the released encoder and quantiser at toy
#: width, its 64 codes being the tiny tokenizer's 64 visual ids (``NUM_VISUAL_TOKENS``), patch 14 as released.
TINY_GEN_TOKENIZER_CONFIG = {"embed_dim": 32, "num_blocks": 2, "num_heads": 2, "mlp_hidden_dim": 64,
                             "codebook_embed_dim": 4, "codebook_size": NUM_VISUAL_TOKENS}
#: Seed of the tiny MammothTok's random weights (``mammothtok.init_random_``).
TINY_GEN_TOKENIZER_SEED = 3


def tiny_gen_tokenizer_tensors() -> dict[str, torch.Tensor]:
    """The tiny MammothTok's full tensor set under ``gen_tokenizer.image_tokenizer.`` (the released key layout,
    ``mammothtok.CHECKPOINT_PREFIX``): random, the same on every call. Present in a Dev checkpoint beside
    ``llm_model``, skipped by the AR loader and loaded by ``load_mammothtok`` to tokenise an edit's input image."""
    from ar_service.model.mammothtok import CHECKPOINT_PREFIX, MammothTok, init_random_

    model = init_random_(MammothTok.from_config(TINY_GEN_TOKENIZER_CONFIG), seed=TINY_GEN_TOKENIZER_SEED)
    return {f"{CHECKPOINT_PREFIX}{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def tiny_dev_llm_parts() -> tuple[dict, dict[str, torch.Tensor]]:
    """(llm_config for config.json, tensors with full checkpoint keys: ``llm_model.*`` and the tiny MammothTok's
    ``gen_tokenizer.image_tokenizer.*``, whose sizes the root config's ``gen_tokenizer_config`` must carry:
    ``TINY_GEN_TOKENIZER_CONFIG``); same values on every call.

    The q/k norm weights get large random offsets (0.3 std) and the other norms small ones, so that a q_norm / k_norm
    that is swapped, skipped or applied after RoPE changes the outputs."""
    llm_config = tiny_dev_llm_config()
    config = ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": llm_config,
                                  "gen_condition_layers": list(TINY_DEV_CONDITION_LAYERS)})
    model = build_random_ar(config, "cpu", torch.float32, seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
            elif name.endswith(".bias") or name.endswith("norm.weight"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    tensors = {f"{LLM_PREFIX}{k}": v.detach().clone() for k, v in model.state_dict().items()}
    tensors.update(_stub_dev_vision_tensors(llm_config["vision_config"], generator))
    tensors.update(tiny_gen_tokenizer_tensors())
    return llm_config, tensors


def tiny_t2i() -> T2IGenerationConfig:
    start = TEXT_VOCAB_SIZE + GEN_RESERVED_SLOTS
    return T2IGenerationConfig(
        eol_token_id=TEXT_VOCAB_SIZE,  # <|endofline|>, the first generation id
        visual_token_start_id=start,
        visual_token_end_id=start + NUM_VISUAL_TOKENS,  # exclusive
        temperature=1.0,
        top_k=2048,  # MammothModa2's default; larger than the tiny visual range, so a no-op here
        top_p=1.0,
        do_sample=True,
    )


def write_tiny_tokenizer_and_t2i(root: Path, t2i: T2IGenerationConfig | None = None) -> None:
    """Tokenizer files and t2i_generation_config.json (``tiny_t2i()`` unless given) at the root; same bytes on
    every call."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    t2i = t2i or tiny_t2i()
    tokenizer = build_tokenizer()
    assert tokenizer.convert_tokens_to_ids(EOL_TOKEN) == t2i.eol_token_id
    tokenizer.save_pretrained(str(root))
    t2i.save(root)


def preview_llm_config() -> dict:
    """MammothModa2-Preview's AR shapes (see module docstring), as config.json's ``llm_config``."""
    text = {
        "vocab_size": PREVIEW_TEXT_VOCAB,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "extra_gen_vocab": True,
        "gen_vocab_size": PREVIEW_GEN_VOCAB,
        "gen_vocab_start_index": PREVIEW_TEXT_VOCAB,
        "moe_type": "ffn-14:28",
    }
    ids = {
        "image_token_id": PREVIEW_IMAGE_TOKEN_ID,
        "video_token_id": PREVIEW_VIDEO_TOKEN_ID,
        "vision_start_token_id": PREVIEW_VISION_START_TOKEN_ID,
        "vision_end_token_id": PREVIEW_VISION_END_TOKEN_ID,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
    }
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
              "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
              "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]}
    return _llm_config(text, ids, vision)


# Dev token ids (Mammothmoda2Qwen3VLConfig defaults, QC:278-281; the Qwen specials keep their Qwen2.5 ids in Dev).
DEV_IMAGE_TOKEN_ID = 151655
DEV_VIDEO_TOKEN_ID = 151656
DEV_VISION_START_TOKEN_ID = 151652
DEV_VISION_END_TOKEN_ID = 151653
DEV_GEN_VOCAB_START = 152064
DEV_GEN_VOCAB = 32800


def dev_llm_config() -> dict:
    """MammothModa2-Dev's AR shapes as config.json's ``llm_config``: Qwen3-VL-8B's text decoder (hidden 4096, 36 layers,
    32 q / 8 kv heads, head_dim 128, FFN 12288, RMSNorm eps 1e-6, rope_theta 5e6, interleaved mrope_section
    [24, 20, 20]) and the Dev generation vocabulary (32800 ids from 152064).

    Unverified (the released config.json is not public): ``vocab_size`` 151936 is the Dev text config class's default
    (upstream Qwen3-VL's), which leaves a 128-id skew against gen_vocab_start_index 152064 (``ARConfig.gen_logit_start``);
    ``moe_type`` "ffn-16:36" (20 expert layers, about 3.0B, matching the README's "3B gen experts") is a guess from that
    arithmetic; so is max_position_embeddings 262144 (Qwen3-VL-8B's). Timing does not depend on these beyond the head
    width and the expert count."""
    text = {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "extra_gen_vocab": True,
        "gen_vocab_size": DEV_GEN_VOCAB,
        "gen_vocab_start_index": DEV_GEN_VOCAB_START,
        "moe_type": "ffn-16:36",
    }
    ids = {
        "image_token_id": DEV_IMAGE_TOKEN_ID,
        "video_token_id": DEV_VIDEO_TOKEN_ID,
        "vision_start_token_id": DEV_VISION_START_TOKEN_ID,
        "vision_end_token_id": DEV_VISION_END_TOKEN_ID,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
    }
    vision = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
              "num_heads": 16, "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "out_hidden_size": 4096, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
    return _llm_config(text, ids, vision, dev=True)


def write_preview_tokenizer_and_t2i(root: Path, t2i: T2IGenerationConfig = PREVIEW_T2I) -> None:
    """Preview-id-compatible tokenizer files and Preview's t2i_generation_config.json (about a second)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_preview_tokenizer(PREVIEW_TEXT_VOCAB, PREVIEW_GEN_VOCAB)
    assert tokenizer.convert_tokens_to_ids(EOL_TOKEN) == t2i.eol_token_id
    assert tokenizer.convert_tokens_to_ids("<|visual token 0|>") == t2i.visual_token_start_id
    tokenizer.save_pretrained(str(root))
    t2i.save(root)


def root_config(llm_config: dict, gen_parts: dict) -> dict:
    """The root config.json of a written checkpoint.

    ``transformers_version`` names the release that wrote the tokenizer files beside it, as every config saved by
    transformers does. transformers 5.x reads it when it loads a tokenizer of over 100,000 ids from a directory (the
    Preview-shaped one): without it, releases up to at least 5.17 take the directory for a Mistral checkpoint saved
    before 5.0 and warn of an "incorrect regex pattern" (docs/models/mammothmoda2.md)."""
    return {
        "model_type": "mammothmoda2",
        "architectures": ["Mammothmoda2Model"],
        "transformers_version": transformers.__version__,
        "llm_config": llm_config,
        **gen_parts,
    }


# Stubs the root needs for servicekit.checkpoint.PipelineCheckpoint.size_multiple when only the AR is present.
AR_ONLY_GEN_STUBS = {"gen_dit_config": {"patch_size": 2}, "gen_vae_config": {"block_out_channels": [8, 8, 8, 8]}}
# Dev: its DiT holds the Q-Former (gen_dit_config.is_image_embedder), which is how a root tells the members apart; and
# its gen_condition_layers.
AR_ONLY_DEV_GEN_STUBS = {"gen_dit_config": {"patch_size": 2, "is_image_embedder": True},
                         "gen_vae_config": {"block_out_channels": [8, 8, 8, 8]},
                         "gen_condition_layers": list(TINY_DEV_CONDITION_LAYERS),
                         "gen_tokenizer_config": TINY_GEN_TOKENIZER_CONFIG}


def write_ar_only_root(root: Path, preview: bool = False, weights: bool = True, dev: bool = False) -> Path:
    """A checkpoint root with only the AR parts (config.json with llm_config and gen_* stubs); for tests.

    ``preview`` writes the Preview shapes and tokenizer with no weights (random-weights mode) and no
    ardit_serving.json (the released grid); the tiny one says its grid (``TINY_GRID``) in ardit_serving.json.
    ``dev`` writes the tiny Dev AR (``tiny_dev_llm_parts``, its tiny MammothTok included) instead of
    the tiny Preview one.
    """
    from servicekit.checkpoint import SERVING_FILE, save_tensors

    if preview and dev:
        raise ValueError("write_ar_only_root writes the Preview shapes or the tiny Dev AR, not both")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if preview:
        llm_config, tensors = preview_llm_config(), None
        write_preview_tokenizer_and_t2i(root)
    else:
        llm_config, tensors = tiny_dev_llm_parts() if dev else tiny_llm_parts()
        write_tiny_tokenizer_and_t2i(root)
    config = root_config(llm_config, AR_ONLY_DEV_GEN_STUBS if dev else AR_ONLY_GEN_STUBS)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if weights and tensors is not None:
        save_tensors(root, tensors)
    if not preview:
        (root / SERVING_FILE).write_text(json.dumps(TINY_GRID, indent=2, sort_keys=True) + "\n")
    return root
