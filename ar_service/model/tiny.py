"""The tiny MammothModa2-family AR used by tests, CI and `make up` on the CPU (random weights, ~0.6 MB)."""

from __future__ import annotations

from pathlib import Path

import torch

from ar_service.model.configuration import MammothARConfig
from ar_service.model.modeling import MammothARModel
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tokenizer import (
    EOL_TOKEN,
    GEN_VOCAB_SIZE,
    NUM_VISUAL_TOKENS,
    TEXT_VOCAB_SIZE,
    build_tokenizer,
    visual_token,
)

TINY_HIDDEN_SIZE = 64


def write_tiny_ar(directory: Path) -> None:
    """Write config, safetensors weights, tokenizer and t2i config; same bytes on every call."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = MammothARConfig(
        vocab_size=TEXT_VOCAB_SIZE,
        gen_vocab_size=GEN_VOCAB_SIZE,
        gen_vocab_start_index=TEXT_VOCAB_SIZE,
        hidden_size=TINY_HIDDEN_SIZE,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        moe_type="ffn",
        pixels_per_token=16,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG
        torch.manual_seed(0)
        model = MammothARModel(config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    T2IGenerationConfig(
        temperature=1.0,
        top_k=2048,  # MammothModa2's default; larger than the tiny visual range, so a no-op here
        top_p=1.0,
        eol_token_id=ids(EOL_TOKEN),
        visual_token_start_id=ids(visual_token(0)),
        visual_token_end_id=ids(visual_token(NUM_VISUAL_TOKENS - 1)),
    ).save(directory)
