"""The tiny DiT-stage parts of the test checkpoint, in the upstream MammothModa2 layout.

``tiny_gen_parts`` returns the config.json entries (gen_dit_config, gen_vae_config, ...) and the tensors with their
full checkpoint keys (``gen_transformer.*``, ``gen_vae.*``, ``gen_image_condition_refiner.*``); tools/make_tiny.py
merges them with the AR's into one root, so tests load exactly the path a real checkpoint takes.
``tiny_dev_gen_parts`` (``tiny_gen_parts(..., dev=True)``) is the same tiny DiT in the Dev layout: the Q-Former inside
it (``gen_dit_config.is_image_embedder``, tensors under ``gen_transformer.time_caption_embed.image_embedder.*``).
Deterministic: same arguments, same bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from dit_service.model.pipeline import DIT_PREFIX, REFINER_PREFIX, VAE_PREFIX, build_modules
from dit_service.model.weights import materialize, random_init_

TINY_DIT_CONFIG: dict[str, Any] = {
    "_class_name": "Transformer2DModel",
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": None,
    "hidden_size": 64,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "num_attention_heads": 2,  # head_dim 32 = 8 + 12 + 12
    "num_kv_heads": 1,
    "multiple_of": 16,
    "ffn_dim_multiplier": 0.5,  # inner 128
    "norm_eps": 1e-5,
    "axes_dim_rope": [8, 12, 12],
    "axes_lens": [10000, 10000, 10000],
    "text_feat_dim": 64,
    "timestep_scale": 1.0,
}

# Flux VAE's latent normalisation constants, so decode exercises the same scale-and-shift path.
TINY_VAE_CONFIG: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 8, 8],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 4,
    "sample_size": 256,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

TINY_REFINER_CONFIG = {"num_queries": 16, "num_layers": 2}
#: The Dev layout's Q-Former inside the tiny DiT: 16 queries, 2 layers, max(1, 64 // 128) = 1 head of width 64.
TINY_IMAGE_EMBEDDER_CONFIG = {"num_queries": 16, "num_layers": 2}

SEED = 0


def tiny_gen_parts(
    llm_hidden_size: int, with_refiner: bool = False, dev: bool = False
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json entries, float32 tensors with full checkpoint keys) of the tiny DiT stage.

    ``with_refiner`` adds a 16-query, 2-layer Q-Former image refiner beside the DiT (the Preview layout; Preview has a
    128-query one). ``dev``: the Dev layout instead, a 16-query, 2-layer Q-Former inside the DiT
    (``gen_dit_config.is_image_embedder``; ``gen_image_condition_refiner_config`` then sizes it)."""
    if dev and with_refiner:
        raise ValueError("the Dev layout has its Q-Former inside the DiT and no refiner beside it")
    dit_config = dict(TINY_DIT_CONFIG, text_feat_dim=llm_hidden_size)
    refiner_config = dict(TINY_REFINER_CONFIG) if with_refiner else None
    if dev:
        dit_config["is_image_embedder"] = True
        refiner_config = dict(TINY_IMAGE_EMBEDDER_CONFIG)
    parts = {
        "gen_dit_config": dit_config,
        "gen_vae_config": dict(TINY_VAE_CONFIG),
        "gen_image_condition_refiner_config": refiner_config,
        "gen_axes_dim_rope": list(TINY_DIT_CONFIG["axes_dim_rope"]),
        "gen_axes_lens": list(TINY_DIT_CONFIG["axes_lens"]),
        "gen_transport_config": {},
        "gen_condition_mode": "text_image",
    }
    dit, vae, refiner = build_modules(dict(parts, llm_config={"text_config": {"hidden_size": llm_hidden_size}}))
    tensors: dict[str, torch.Tensor] = {}
    modules: list[tuple[str, torch.nn.Module]] = [(DIT_PREFIX, dit), (VAE_PREFIX, vae)]
    if refiner is not None:
        modules.append((REFINER_PREFIX, refiner))
    for i, (prefix, module) in enumerate(modules):
        random_init_(materialize(module, "cpu", torch.float32), seed=SEED + i)
        tensors.update({prefix + name: t.detach().clone().contiguous() for name, t in module.state_dict().items()})
    return parts, tensors


def tiny_dev_gen_parts(llm_hidden_size: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """``tiny_gen_parts`` in the Dev layout: the tiny DiT with its 16-query, 2-layer Q-Former inside it."""
    return tiny_gen_parts(llm_hidden_size, dev=True)
