"""Load the AR of a MammothModa2 checkpoint directory: local files only, safetensors only, strict keys.

The AR's tensors are the checkpoint's ``llm_model.*`` (bytedance/mammothmoda ``modeling_mammothmoda2.py``:
``Mammothmoda2Model.llm_model``; vllm-omni's ``MammothModa2ARForConditionalGeneration.hf_to_vllm_mapper`` maps
the same names). Every one of them must be a parameter of ``MammothModa2AR`` or lie under the vision tower
(``llm_model.model.visual.``), which text-to-image never runs and which is therefore neither allocated nor read;
every parameter must be present. Anything else fails the load, naming the keys.

The Dev member's checkpoint also holds ``gen_tokenizer.*`` beside ``llm_model`` (MammothTok, bytedance/mammothmoda
main ``mamoda2/mammothmoda2/model/modeling_mammothmoda2.py:125``): it turns an input image into prompt tokens for
editing and plays no part in text-to-image; the AR loader neither builds nor reads it, and says so, listing how many
tensors it leaves (``SKIPPED_ROOT_PREFIXES``). ``load_ar`` then loads it on its own (``load_edit_tokenizer``,
ar_service/model/mammothtok.py) when the checkpoint is Dev and holds its tensors: the model then edits; otherwise
``LoadedAR.edit_refusal`` says why it cannot. Dev's vision tower (DeepStack mergers included) lies under
``llm_model.model.visual.`` like Preview's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from ar_service.model.configuration import ARConfig, ar_config_from_dict
from ar_service.model.modeling import MammothModa2AR
from ar_service.model.quantize import quantize_ar_
from ar_service.model.t2i_config import T2I_CONFIG_NAME, T2IGenerationConfig
from servicekit.checkpoint import PipelineCheckpoint, open_checkpoint
from servicekit.fp8 import check_quantization

log = logging.getLogger(__name__)

LLM_PREFIX = "llm_model."
# Keys under llm_model. that exist in the checkpoint but that the AR stage deliberately does not build.
SKIPPED_PREFIXES = ("model.visual.",)
# Checkpoint keys outside llm_model. that belong to the AR side but are deliberately not built, per member: Dev's
# MammothTok image tokenizer (editing only).
SKIPPED_ROOT_PREFIXES: dict[str, tuple[str, ...]] = {"preview": (), "dev": ("gen_tokenizer.",)}
# What the AR reads (relative to llm_model.): the decoder and both heads.
AR_PREFIXES = ("model.language_model.", "lm_head.", "gen_head.")


@dataclass
class LoadedAR:
    model: MammothModa2AR
    tokenizer: PreTrainedTokenizerFast
    t2i: T2IGenerationConfig
    config: ARConfig
    checkpoint: PipelineCheckpoint
    #: The Dev member's input-image tokenizer (editing); None when the model cannot edit (``edit_refusal`` says why).
    mammothtok: Any = None
    edit_refusal: str = ""


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors and the model's parameters disagree; the message names the keys."""


def key_report(expected: set[str], found: set[str]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, skipped): names relative to ``llm_model.``."""
    skipped = sorted(k for k in found if k.startswith(SKIPPED_PREFIXES))
    rest = found.difference(skipped)
    return sorted(expected - rest), sorted(rest - expected), skipped


def _describe(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def build_ar(config: ARConfig, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> MammothModa2AR:
    """The module tree with uninitialised storage (on ``meta`` by default: no memory at all)."""
    with torch.device("meta"):
        model = MammothModa2AR(config).to(dtype)
    if torch.device(device).type != "meta":
        model = model.to_empty(device=device)
        model.model.language_model.reset_rope(torch.device(device))
    return model


@torch.no_grad()
def init_random_(model: MammothModa2AR, seed: int = 0) -> MammothModa2AR:
    """Random init in place on the model's device (normal(0, initializer_range) weights, zero biases, unit norms),
    as upstream ``_init_weights`` does; deterministic for a seed on a given device."""
    std = model.config.initializer_range
    generator = torch.Generator(device=model.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)
    return model


def build_random_ar(
    config: ARConfig | dict, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> MammothModa2AR:
    """Preview-shaped (or any) AR with random weights, allocated straight on ``device``: no CPU round trip.

    ``config`` is an ``ARConfig`` or an ``llm_config`` dict (e.g. ``tiny.preview_llm_config()``).
    """
    if isinstance(config, dict):
        config = ar_config_from_dict({"model_type": "mammothmoda2", "llm_config": config})
    return init_random_(build_ar(config, device, dtype), seed).eval()


def load_ar_weights(checkpoint: PipelineCheckpoint, config: ARConfig, device, dtype) -> MammothModa2AR:
    """Strict load of ``llm_model.*``: the key check runs on names before a single tensor is read."""
    model = build_ar(config, "meta", dtype)
    expected = set(model.state_dict())
    found = {name[len(LLM_PREFIX):] for name in checkpoint.tensor_names(LLM_PREFIX)}
    missing, unexpected, skipped = key_report(expected, found)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {_describe(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {_describe(unexpected)}")
        raise CheckpointMismatch(
            f"AR weights in {checkpoint.root} do not match llm_config (moe_type {config.moe_type!r}, "
            f"{config.num_hidden_layers} layers): " + "; ".join(f"{LLM_PREFIX}* {p}" for p in parts)
        )
    if skipped:
        log.info("not loading %d vision-tower tensors under %smodel.visual. (not used for text-to-image)", len(skipped), LLM_PREFIX)
    for prefix, names in skipped_root_tensors(checkpoint, config).items():
        log.info("not loading %d tensors under %s (the %s member's MammothTok image tokenizer: editing only, not used "
                 "for text-to-image)", len(names), prefix, config.member)
    # Read only what the AR uses: the language model and both heads, not the vision tower.
    tensors: dict[str, torch.Tensor] = {}
    for sub in AR_PREFIXES:
        for name, tensor in checkpoint.load_tensors(f"{LLM_PREFIX}{sub}", device, dtype).items():
            tensors[f"{sub}{name}"] = tensor
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensors[name] = tensor.to(dtype)
    shapes = model.state_dict()
    bad = [f"{n} {tuple(t.shape)} != {tuple(shapes[n].shape)}" for n, t in tensors.items() if t.shape != shapes[n].shape]
    if bad:
        raise CheckpointMismatch(f"AR weights in {checkpoint.root} have the wrong shapes: {_describe(sorted(bad))}")
    model.load_state_dict(tensors, strict=True, assign=True)
    model.model.language_model.reset_rope(torch.device(device))
    return model.eval()


def skipped_root_tensors(checkpoint: PipelineCheckpoint, config: ARConfig) -> dict[str, list[str]]:
    """The checkpoint's tensors under the member's ``SKIPPED_ROOT_PREFIXES`` (full names), by prefix."""
    found = {prefix: checkpoint.tensor_names(prefix) for prefix in SKIPPED_ROOT_PREFIXES[config.member]}
    return {prefix: names for prefix, names in found.items() if names}


def load_tokenizer(root: Path) -> PreTrainedTokenizerFast:
    if not (Path(root) / "tokenizer.json").is_file():
        if (Path(root) / "mammothu.tiktoken").is_file():
            raise FileNotFoundError(
                f"{root} ships the MammothU tiktoken tokenizer (mammothu.tiktoken) but no tokenizer.json; "
                "ardit loads fast tokenizers only: convert it to tokenizer.json first"
            )
        raise FileNotFoundError(f"{root} has no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)


def load_ar(
    source: PipelineCheckpoint | str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    random_weights: bool = False,
    seed: int = 0,
    quantization: str = "none",
) -> LoadedAR:
    """Config, tokenizer and t2i config from the checkpoint root; weights from its safetensors, or random.

    With ``random_weights`` the directory needs only config.json, the tokenizer and the t2i config.
    ``quantization`` "fp8": the decode path's linears are quantized to e4m3 after loading (``quantize.py``).
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # service logs, not a terminal
    checkpoint = source if isinstance(source, PipelineCheckpoint) else open_checkpoint(source, require_weights=not random_weights)
    config = ar_config_from_dict(checkpoint.config)
    t2i = T2IGenerationConfig.load(checkpoint.root)
    tokenizer = load_tokenizer(checkpoint.root)
    _check_ids(checkpoint.root, config, t2i, tokenizer)
    if t2i.repetition_penalty != 1.0:
        log.warning("%s sets repetition_penalty %s; ardit does not apply it", T2I_CONFIG_NAME, t2i.repetition_penalty)
    if random_weights:
        model = build_random_ar(config, device, dtype, seed)
    else:
        model = load_ar_weights(checkpoint, config, device, dtype)
    check_quantization(quantization)
    if quantization == "fp8":
        quantize_ar_(model)
    mammothtok, refusal = load_edit_tokenizer(checkpoint, config, device, dtype, random_weights, seed)
    return LoadedAR(model=model, tokenizer=tokenizer, t2i=t2i, config=config, checkpoint=checkpoint,
                    mammothtok=mammothtok, edit_refusal=refusal)


def load_edit_tokenizer(
    checkpoint: PipelineCheckpoint,
    config: ARConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    random_weights: bool = False,
    seed: int = 0,
) -> tuple[Any, str]:
    """(MammothTok, "") when the model edits, else (None, why not). Only the Dev member has an input-image tokenizer
    (``gen_tokenizer.image_tokenizer.*``, sizes from the root config's optional ``gen_tokenizer_config``); a Dev
    checkpoint without its tensors, or with a set that does not match those sizes, serves text-to-image and refuses
    edits, naming the reason (logged here once)."""
    from ar_service.model.mammothtok import (
        CHECKPOINT_PREFIX,
        MammothTok,
        MammothTokConfig,
        MammothTokMismatch,
        init_random_,
        load_mammothtok,
    )

    if config.member != "dev":
        return None, (f"the served model is a MammothModa2 {config.member} checkpoint, which has no input-image "
                      "tokenizer (MammothTok, MammothModa2-Dev's): it generates from text only")
    if random_weights:
        tokenizer = init_random_(MammothTok.from_config(MammothTokConfig.from_root_config(checkpoint.config)), seed)
        return tokenizer.to(device=device, dtype=dtype).eval(), ""
    if not checkpoint.tensor_names(CHECKPOINT_PREFIX):
        refusal = (f"the served Dev checkpoint {checkpoint.root} holds no {CHECKPOINT_PREFIX}* tensors (MammothTok, the "
                   "input-image tokenizer): it generates from text only")
        log.warning("editing is off: %s", refusal)
        return None, refusal
    try:
        tokenizer, report = load_mammothtok(checkpoint, device, dtype, log=log.info)
    except MammothTokMismatch as exc:
        refusal = f"the served checkpoint's input-image tokenizer (MammothTok) does not load: {exc}"
        log.warning("editing is off: %s", refusal)
        return None, refusal
    log.info("MammothTok loaded for editing: %d tensors, %d parameters", len(report.loaded), tokenizer.num_parameters())
    return tokenizer, ""


def _check_ids(root: Path, config: ARConfig, t2i: T2IGenerationConfig, tokenizer: PreTrainedTokenizerFast) -> None:
    # The id space: logit columns [0, vocab_size + gen_vocab_size), and generation ids with an embedding row up to
    # gen_vocab_start_index + gen_vocab_size; the two differ when the Dev member's text vocabulary is not 152064.
    id_space = max(config.total_vocab_size, config.gen_vocab_start_index + config.gen_vocab_size)
    if len(tokenizer) > id_space:
        raise ValueError(f"tokenizer in {root} has {len(tokenizer)} ids; the model has {id_space}")
    # Ids the decode emits must be gen_head columns (logit index == id, from gen_logit_start) and generation tokens
    # with an embedding row (from gen_vocab_start_index): config.gen_id_range, the whole generation vocabulary
    # unless the two starts differ.
    ids = config.gen_id_range
    if t2i.eol_token_id not in ids:
        raise ValueError(f"{T2I_CONFIG_NAME} in {root}: eol_token_id lies outside the generation vocabulary "
                         f"[{ids.start}, {ids.stop})")
    if not (ids.start <= t2i.visual_token_start_id and t2i.visual_token_end_id <= ids.stop):
        raise ValueError(f"{T2I_CONFIG_NAME} in {root}: visual tokens lie outside the generation vocabulary "
                         f"[{ids.start}, {ids.stop})")
    for token in ("<|image start|>", "<|image token|>", "<|im_start|>", "<|im_end|>"):
        if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ValueError(f"tokenizer in {root} lacks {token}, which the T2I prompt needs")
