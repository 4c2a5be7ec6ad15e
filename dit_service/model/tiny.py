"""Writes a tiny random-weight DiT stack (transformer, VAE, scheduler config) for tests, CI and CPU demos.

Deterministic: the same call writes byte-identical files, so fixtures and caches can be compared by hash.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from dit_service.model.transformer import ArditDiTTransformer

# The flow-matching schedule the sampler expects: resolution-dependent shift applied through mu (see sampler.py).
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}

# Flux VAE's latent normalisation constants (black-forest-labs/FLUX.1 vae/config.json), reused so decode
# exercises the same scale-and-shift path as a real 16-channel VAE.
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159

# Output-layer std: large enough that seed and condition visibly change the image, small enough to stay sane.
OUTPUT_INIT_STD = 0.05


def tiny_transformer(condition_dim: int) -> ArditDiTTransformer:
    model = ArditDiTTransformer(
        in_channels=16,
        patch_size=2,
        hidden_size=64,
        num_layers=2,
        num_context_refiner_layers=1,
        num_noise_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(8, 12, 12),
        cond_dim=condition_dim,
    )
    with torch.no_grad():
        model.proj_out.weight.normal_(0.0, OUTPUT_INIT_STD)
        model.proj_out.bias.zero_()
    return model


def tiny_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=256,
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def write_tiny_dit_stack(root: Path, condition_dim: int = 64) -> None:
    """Writes root/dit, root/vae and root/scheduler/scheduler_config.json (a few hundred KB)."""
    root = Path(root)
    torch.manual_seed(0)
    tiny_transformer(condition_dim).save_pretrained(root / "dit", safe_serialization=True)
    torch.manual_seed(1)
    tiny_vae().save_pretrained(root / "vae", safe_serialization=True)
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    text = json.dumps(SCHEDULER_CONFIG, indent=2, sort_keys=True) + "\n"
    (root / "scheduler" / "scheduler_config.json").write_text(text)
