"""What each stage of one request has to do, counted from the checkpoint's own config: the weight bytes one AR
decode token reads and the FLOPs of one image's denoise. Nothing here loads a model or times anything; the
harness sets these counts against the stages' timings and the machine's measured bounds (``bench.bounds``,
``bench.ratios``).

The counts follow the module trees in ``ar_service/model/modeling.py`` and ``dit_service/model/transformer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ar_service.model.configuration import ARConfig
from ar_service.model.modeling import count_decode_parameters
from dit_service.model.layers import ffn_inner_dim
from dit_service.model.sampler import uses_cfg

# -- AR: bytes per decode token --------------------------------------------------------------------------------------


def decode_weight_bytes(config: ARConfig, dtype_bytes: int = 2) -> int:
    """Weight bytes one text-to-image decode token reads, at batch 1 (``count_decode_parameters``)."""
    return count_decode_parameters(config) * dtype_bytes


# -- DiT: FLOPs of a denoise -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiTShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    refiner_layers: int
    patch_dim: int  # p * p * in_channels
    out_dim: int  # p * p * out_channels
    patch: int
    condition_dim: int  # the AR's hidden size (caption_embedder input)
    vae_scale: int

    @classmethod
    def from_root_config(cls, config: dict) -> DiTShape:
        from dit_service.model.pipeline import llm_hidden_size

        dit = config["gen_dit_config"]
        hidden, heads = int(dit["hidden_size"]), int(dit["num_attention_heads"])
        p, c = int(dit.get("patch_size", 2)), int(dit.get("in_channels", 16))
        out_c = int(dit.get("out_channels") or c)
        vae_blocks = len(config["gen_vae_config"]["block_out_channels"])
        return cls(
            hidden=hidden, heads=heads, kv_heads=int(dit["num_kv_heads"]), head_dim=hidden // heads,
            ffn=ffn_inner_dim(hidden, int(dit.get("multiple_of", 256)), dit.get("ffn_dim_multiplier")),
            layers=int(dit["num_layers"]), refiner_layers=int(dit.get("num_refiner_layers", 2)),
            patch_dim=p * p * c, out_dim=p * p * out_c, patch=p, condition_dim=llm_hidden_size(config),
            vae_scale=2 ** (vae_blocks - 1),
        )

    def latent_tokens(self, width: int, height: int) -> int:
        """Image patches: (H/8/p) * (W/8/p)."""
        return (height // self.vae_scale // self.patch) * (width // self.vae_scale // self.patch)

    def block_flops(self, tokens: int, modulated: bool, sample_rows: int = 1) -> tuple[float, float]:
        """(linear, attention) FLOPs of one transformer block over ``tokens`` rows: its linear layers
        (2 * params * tokens; the modulation linear runs on ``sample_rows`` rows) and attention (QK^T and AV:
        4 * L^2 * head_dim * heads)."""
        d, hd = self.hidden, self.head_dim
        linear_params = d * self.heads * hd + 2 * d * self.kv_heads * hd + self.heads * hd * d + 3 * d * self.ffn
        linear = 2.0 * linear_params * tokens + (2.0 * min(d, 1024) * 4 * d * sample_rows if modulated else 0.0)
        return linear, 4.0 * tokens**2 * hd * self.heads

    def forward_flops_parts(self, condition_tokens: int, image_tokens: int, sample_rows: int = 1) -> tuple[float, float]:
        """(linear, attention) FLOPs of one transformer evaluation of one sample: condition projection and context
        refiner (condition rows), x_embedder and noise refiner (image rows), the joint layers and the output
        projection (both). Norms, RoPE and the Euler update are elementwise and left out. The per-sample linears
        (timestep embedding, modulation) count ``sample_rows`` rows: 1 is the useful work; the transformer pads
        them to ``MIN_ROWS`` (16), which a FLOP counter sees."""
        d = self.hidden
        joint = condition_tokens + image_tokens
        linear = 2.0 * (256 * min(d, 1024) + min(d, 1024) ** 2) * sample_rows  # timestep embedding
        attention = 0.0
        blocks = [(image_tokens, True, self.refiner_layers), (joint, True, self.layers)]
        if condition_tokens:
            linear += 2.0 * self.condition_dim * d * condition_tokens
            blocks.append((condition_tokens, False, self.refiner_layers))
        linear += 2.0 * self.patch_dim * d * image_tokens
        for tokens, modulated, count in blocks:
            block_linear, block_attention = self.block_flops(tokens, modulated, sample_rows)
            linear += count * block_linear
            attention += count * block_attention
        linear += 2.0 * min(d, 1024) * d * sample_rows + 2.0 * d * self.out_dim * joint  # norm_out
        return linear, attention

    def forward_flops(self, condition_tokens: int, image_tokens: int) -> float:
        return sum(self.forward_flops_parts(condition_tokens, image_tokens))


def condition_tokens(config: dict, text_positions: int, grid_width: int, grid_height: int) -> int:
    """Rows the DiT's conditional branch sees: the text condition when ``gen_condition_mode`` has "text", and the
    image condition when it has "image": ``ar_h * (ar_w + 1)`` rows, or the refiner's ``num_queries`` rows when the
    checkpoint has a Q-Former refiner (it replaces the image condition before the DiT; dit_service/model/refiner.py).
    """
    from ar_service.prompt import Grid
    from dit_service.model.pipeline import DEFAULT_CONDITION_MODE, build_modules

    mode = config.get("gen_condition_mode") or DEFAULT_CONDITION_MODE
    rows = text_positions if "text" in mode else 0
    if "image" in mode:
        with torch.device("meta"):  # the refiner as the DiT stage builds it, without memory
            _, _, refiner = build_modules(config)
        rows += refiner.num_queries if refiner is not None else Grid(grid_width, grid_height).condition_positions
    return rows


def denoise_flops(
    config: dict,
    width: int,
    height: int,
    steps: int,
    text_positions: int,
    grid_width: int,
    grid_height: int,
    guidance: float,
    cfg_range: tuple[float, float] = (0.0, 1.0),
    uncond_positions: int = 0,
) -> dict:
    """FLOPs of one image's denoise: per step the conditional branch, plus the unconditional one (its own, shorter
    sequence: ``uncond_positions`` rows, 0 without a negative prompt) on the steps guidance applies to."""
    shape = DiTShape.from_root_config(config)
    image = shape.latent_tokens(width, height)
    cond = condition_tokens(config, text_positions, grid_width, grid_height)
    cond_flops = shape.forward_flops(cond, image)
    uncond_flops = shape.forward_flops(uncond_positions, image)
    guided = sum(uses_cfg(i, steps, guidance, cfg_range) for i in range(steps))
    total = steps * cond_flops + guided * uncond_flops
    return {
        "image_tokens": image, "condition_tokens": cond, "uncond_tokens": uncond_positions,
        "transformer_calls": steps + guided, "flops": total,
        "cond_forward_flops": cond_flops, "uncond_forward_flops": uncond_flops,
    }
