"""The shapes model's sizes, and its modules built fresh from them: the same classes the services load.

- AR: ``MammothModa2AR`` at hidden 128, 4 layers, 4 / 2 heads, FFN 352, FFN generation experts on every layer
  (``moe_type`` "ffn"), the tiny tokenizer's 512 text ids and 72 generation ids (EOL, header, 64 visual tokens).
- DiT: ``MammothDiT`` at hidden 128, 4 joint layers, 1 layer per refiner, 4 / 2 heads (head_dim 32 = 8+12+12).
- VAE: diffusers ``AutoencoderKL``, 4 blocks (8x down), 16 latent channels: a 128x128 image is a 16x16 latent,
  64 DiT patches; its scaling and shift factors are set from the trained encoder's latent statistics.
- Condition mode "text_image": the DiT sees [text condition | image condition] as the services hand it over.
Served at 128x128 by default (16 pixels per token: an 8x8 AR grid).
"""

from __future__ import annotations

import copy

import torch

from ar_service.model.configuration import ARConfig, ar_config_from_dict
from ar_service.model.loading import build_random_ar
from ar_service.model.modeling import MammothModa2AR
from ar_service.model.t2i_config import T2IGenerationConfig
from ar_service.model.tiny import tiny_llm_config, tiny_t2i
from dit_service.model.pipeline import build_modules
from dit_service.model.tiny import TINY_DIT_CONFIG, TINY_VAE_CONFIG
from dit_service.model.weights import materialize, random_init_
from servicekit.checkpoint import ServingDefaults

HIDDEN = 128
# The DiT learnt its unconditional branch from the empty condition (train.stages.train_dit), so that is what
# guidance sends by default: no default negative prompt. MammothModa2's guidance 9 is far too strong for this
# model (train/README.md): requests that leave the knobs out get 50 steps at guidance 3, the evaluated setting.
# It draws at most 256x256 (and well only at 128x128, its training size); OpenAI clients send 512x512 or 1024x1024
# unasked, so sizes above 256 are drawn at 128x128 and enlarged 4 or 8 times (max_upscale; the answer states the
# size its pictures have). It learnt an 8x8 grid at 128x128, one visual token per 16x16 pixels (train/visual_tokens.py):
# its grid rule says so (grid_rule pixels_per_token), not the released MammothModa2 grid that ardit serves by default.
SERVING = ServingDefaults(default_width=128, default_height=128, max_side=256, grid_rule="pixels_per_token",
                          pixels_per_token=16, default_negative_prompt="",
                          knob_defaults={"num_inference_steps": 50, "text_guidance_scale": 3.0}, max_upscale=8)


def llm_config() -> dict:
    config = copy.deepcopy(tiny_llm_config())
    config["text_config"].update(
        hidden_size=HIDDEN,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},  # sums to head_dim / 2 = 16
        moe_type="ffn",
    )
    config["moe_type"] = "ffn"
    config["vision_config"]["out_hidden_size"] = HIDDEN
    return config


def gen_parts(vae_scaling: float = 1.0, vae_shift: float = 0.0) -> dict:
    dit = dict(
        TINY_DIT_CONFIG, hidden_size=HIDDEN, num_layers=4, num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2,
        multiple_of=16, ffn_dim_multiplier=0.5, axes_dim_rope=[8, 12, 12], text_feat_dim=HIDDEN,
    )
    vae = dict(
        TINY_VAE_CONFIG, block_out_channels=[32, 32, 48, 48], layers_per_block=1, norm_num_groups=16, sample_size=128,
        scaling_factor=float(vae_scaling), shift_factor=float(vae_shift),
    )
    return {
        "gen_dit_config": dit,
        "gen_vae_config": vae,
        "gen_image_condition_refiner_config": None,
        "gen_axes_dim_rope": list(dit["axes_dim_rope"]),
        "gen_axes_lens": list(dit["axes_lens"]),
        "gen_transport_config": {},
        "gen_condition_mode": "text_image",
    }


def root_config(parts: dict | None = None) -> dict:
    return {"model_type": "mammothmoda2", "llm_config": llm_config(), **(parts or gen_parts())}


def ar_config() -> ARConfig:
    return ar_config_from_dict(root_config())


def t2i() -> T2IGenerationConfig:
    """The tiny tokenizer's ids; greedy and unguided by default (the temperature and ar_cfg_scale knobs still apply)."""
    ids = tiny_t2i()
    return T2IGenerationConfig(
        eol_token_id=ids.eol_token_id, visual_token_start_id=ids.visual_token_start_id,
        visual_token_end_id=ids.visual_token_end_id, temperature=1.0, top_k=2048, top_p=1.0, do_sample=False,
        cfg_scale=1.0,  # no AR guidance by default: the AR never learnt an unconditional branch
    )


def new_ar(device: torch.device, seed: int) -> MammothModa2AR:
    return build_random_ar(ar_config(), device, torch.float32, seed=seed).train()


def new_dit_and_vae(device: torch.device, seed: int):
    """(DiT, VAE) with fresh weights in float32 on ``device``; the DiT's output projection starts at zero."""
    dit, vae, _ = build_modules(root_config())
    random_init_(materialize(dit, device, torch.float32), seed=seed)
    with torch.no_grad():
        dit.norm_out.linear_2.weight.zero_()
        dit.norm_out.linear_2.bias.zero_()
    torch.manual_seed(seed + 1)
    vae = type(vae).from_config(vae.config).to(device)  # diffusers' own initialisation
    return dit.train(), vae.train()
