"""Load an AR directory in Hugging Face layout: local files only, safetensors only, no remote code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from ar_service.model.configuration import MammothARConfig
from ar_service.model.modeling import MammothARModel
from ar_service.model.t2i_config import T2I_CONFIG_NAME, T2IGenerationConfig

REQUIRED_FILES = ("config.json", "tokenizer.json", T2I_CONFIG_NAME)


@dataclass
class LoadedAR:
    model: MammothARModel
    tokenizer: PreTrainedTokenizerFast
    t2i: T2IGenerationConfig
    config: MammothARConfig


def load_ar(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LoadedAR:
    """Fail loudly (with the path) on anything missing rather than half-initialising weights."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"AR model directory {directory} does not exist")
    for name in REQUIRED_FILES:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"AR model directory {directory} lacks {name}")
    if not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"AR model directory {directory} has no .safetensors weights")
    transformers_logging.disable_progress_bar()  # service logs, not a terminal
    model, info = MammothARModel.from_pretrained(
        str(directory), local_files_only=True, use_safetensors=True, dtype=dtype, output_loading_info=True
    )
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ValueError(f"weights in {directory} do not match the model: {problems or info['error_msgs']}")
    model = model.to(device).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    t2i = T2IGenerationConfig.load(directory)
    config = model.config
    if len(tokenizer) != config.total_vocab_size:
        raise ValueError(f"tokenizer in {directory} has {len(tokenizer)} ids, model expects {config.total_vocab_size}")
    for name in ("eol_token_id", "visual_token_start_id", "visual_token_end_id"):
        if not config.gen_vocab_start_index <= getattr(t2i, name) < config.total_vocab_size:
            raise ValueError(f"{T2I_CONFIG_NAME} in {directory}: {name} lies outside the generation vocabulary")
    return LoadedAR(model=model, tokenizer=tokenizer, t2i=t2i, config=config)
