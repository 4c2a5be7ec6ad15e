"""Single-stream DiT in the Lumina2 / OmniGen2 shape, as used by MammothModa2's generation head.

Why our own and not diffusers' ``Lumina2Transformer2DModel``: with diffusers 0.42.1 that model fails on an
empty condition (L=0, the unconditional CFG branch: "cannot reshape tensor of 0 elements" in its attention
processor), and its complex-valued RoPE tables are precomputed for fixed axis lengths. The layout below follows
the same published architecture (condition RMSNorm + Linear, context refiner without timestep modulation, noise
refiner and joint blocks with RMSNorm-based adaLN scale/tanh-gate, GQA attention with QK RMSNorm, SwiGLU, 3-axis
RoPE, adaLN final layer) but is written from scratch.

Conventions (the sampler relies on them):
- ``timestep`` is the flow-matching sigma in [0, 1] (1 = pure noise, 0 = clean), per sample.
- the output is the velocity d(latents)/d(sigma) = noise - x0, so a diffusers ``FlowMatchEulerDiscreteScheduler``
  step applies it as is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 for stability, returned in the input dtype."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_angles(positions: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> torch.Tensor:
    """Rotation angles [B, S, sum(axes_dim)/2] for integer positions [B, S, n_axes], one frequency band per axis."""
    parts = []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
        parts.append(positions[..., axis].to(torch.float64)[..., None] * freqs)
    return torch.cat(parts, dim=-1).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent channel pairs of x [B, S, H, D] (the real form of Lumina's complex RoPE)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None], sin[:, :, None]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with per-head QK RMSNorm and RoPE, via torch SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        self.to_out = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor | None):
        b, s, _ = x.shape
        q = self.norm_q(self.to_q(x).view(b, s, self.heads, self.head_dim))
        k = self.norm_k(self.to_k(x).view(b, s, self.kv_heads, self.head_dim))
        v = self.to_v(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return self.to_out(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def swiglu_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama/Lumina FFN width: 2/3 of 4*dim, optionally scaled, rounded up to a multiple."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class Block(nn.Module):
    """Pre/post-RMSNorm transformer block; with ``modulated`` the timestep sets scales and tanh gates (RMSNormZero)."""

    def __init__(self, dim, heads, kv_heads, ffn_hidden, eps, temb_dim, modulated: bool):
        super().__init__()
        self.eps = eps
        self.attn = Attention(dim, heads, kv_heads, eps)
        self.ffn = SwiGLU(dim, ffn_hidden)
        self.attn_norm_in = RMSNorm(dim, eps)
        self.attn_norm_out = RMSNorm(dim, eps)
        self.ffn_norm_in = RMSNorm(dim, eps)
        self.ffn_norm_out = RMSNorm(dim, eps)
        self.adaln = nn.Linear(temb_dim, 4 * dim) if modulated else None

    def forward(self, x, cos, sin, key_mask, temb=None):
        if self.adaln is None:
            x = x + self.attn_norm_out(self.attn(self.attn_norm_in(x), cos, sin, key_mask))
            return x + self.ffn_norm_out(self.ffn(self.ffn_norm_in(x)))
        scale_attn, gate_attn, scale_ffn, gate_ffn = self.adaln(F.silu(temb))[:, None].chunk(4, dim=-1)
        h = self.attn(self.attn_norm_in(x) * (1 + scale_attn), cos, sin, key_mask)
        x = x + gate_attn.tanh() * self.attn_norm_out(h)
        h = self.ffn(self.ffn_norm_in(x) * (1 + scale_ffn))
        return x + gate_ffn.tanh() * self.ffn_norm_out(h)


class TimestepEmbedding(nn.Module):
    """Sinusoidal features ([cos, sin], as diffusers' Timesteps with flip_sin_to_cos) then a 2-layer MLP."""

    def __init__(self, out_dim: int, freq_dim: int, scale: float):
        super().__init__()
        self.freq_dim, self.scale = freq_dim, scale
        self.linear_1 = nn.Linear(freq_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = (t.float() * self.scale)[:, None] * freqs[None]
        feats = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(feats)))


class ArditDiTTransformer(ModelMixin, ConfigMixin):
    """Condition-to-velocity DiT: forward(latents, sigma, condition, condition_mask) -> velocity."""

    _supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    @register_to_config
    def __init__(
        self,
        in_channels: int = 16,
        out_channels: int | None = None,
        patch_size: int = 2,
        hidden_size: int = 2520,
        num_layers: int = 26,
        num_context_refiner_layers: int = 2,
        num_noise_refiner_layers: int = 2,
        num_attention_heads: int = 21,
        num_kv_heads: int = 7,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (40, 40, 40),
        rope_theta: float = 10000.0,
        cond_dim: int = 3584,
        timestep_freq_dim: int = 256,
        timestep_scale: float = 1.0,
    ):
        super().__init__()
        head_dim = hidden_size // num_attention_heads
        if head_dim * num_attention_heads != hidden_size or sum(axes_dim_rope) != head_dim:
            raise ValueError("hidden_size must split into heads whose head_dim equals sum(axes_dim_rope)")
        if any(d % 2 for d in axes_dim_rope):
            raise ValueError("every RoPE axis needs an even number of channels")
        self.out_channels = out_channels or in_channels
        temb_dim = min(hidden_size, 1024)
        ffn_hidden = swiglu_hidden(hidden_size, multiple_of, ffn_dim_multiplier)

        def blocks(n: int, modulated: bool) -> nn.ModuleList:
            return nn.ModuleList(
                Block(hidden_size, num_attention_heads, num_kv_heads, ffn_hidden, norm_eps, temb_dim, modulated)
                for _ in range(n)
            )

        self.x_embedder = nn.Linear(patch_size * patch_size * in_channels, hidden_size)
        self.t_embedder = TimestepEmbedding(temb_dim, timestep_freq_dim, timestep_scale)
        self.cond_norm = RMSNorm(cond_dim, norm_eps)
        self.cond_proj = nn.Linear(cond_dim, hidden_size)
        self.context_refiner = blocks(num_context_refiner_layers, modulated=False)
        self.noise_refiner = blocks(num_noise_refiner_layers, modulated=True)
        self.layers = blocks(num_layers, modulated=True)
        self.norm_out_scale = nn.Linear(temb_dim, hidden_size)
        self.proj_out = nn.Linear(hidden_size, patch_size * patch_size * self.out_channels)

    # -- token layout -------------------------------------------------------------------------------------------

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        p = self.config.patch_size
        x = latents.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)  # b, gh, gw, p, p, c
        return x.reshape(b, (h // p) * (w // p), p * p * c)

    def _unpatchify(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, p, c = tokens.shape[0], self.config.patch_size, self.out_channels
        x = tokens.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4)  # b, c, gh, p, gw, p
        return x.reshape(b, c, h, w)

    def _positions(self, cond_mask: torch.Tensor, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """3-axis positions: condition token j -> (j, 0, 0) over valid tokens; image patch -> (L_valid, row, col)."""
        b, device = cond_mask.shape[0], cond_mask.device
        cond_pos = torch.zeros(b, cond_mask.shape[1], 3, dtype=torch.long, device=device)
        cond_pos[..., 0] = (cond_mask.long().cumsum(1) - 1).clamp(min=0)
        rows = torch.arange(gh, device=device).repeat_interleave(gw)
        cols = torch.arange(gw, device=device).repeat(gh)
        offset = cond_mask.long().sum(1, keepdim=True).expand(b, gh * gw)
        img_pos = torch.stack([offset, rows.expand(b, -1), cols.expand(b, -1)], dim=-1)
        return cond_pos, img_pos

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = rope_angles(positions, tuple(self.config.axes_dim_rope), self.config.rope_theta)
        return angles.cos(), angles.sin()

    # -- forward --------------------------------------------------------------------------------------------------

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        condition: torch.Tensor,
        condition_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """latents [B,C,h,w], timestep (sigma) [B], condition [B,L,cond_dim] (L may be 0), mask [B,L] -> [B,C,h,w]."""
        b, _, h, w = latents.shape
        p = self.config.patch_size
        gh, gw = h // p, w // p
        n_cond = condition.shape[1]
        padded = condition_mask is not None and not bool(condition_mask.all())
        if condition_mask is None:
            condition_mask = torch.ones(b, n_cond, dtype=torch.bool, device=latents.device)
        condition_mask = condition_mask.to(device=latents.device, dtype=torch.bool)

        temb = self.t_embedder(timestep.to(latents.device).expand(b))
        cond_pos, img_pos = self._positions(condition_mask, gh, gw)
        cond_cos, cond_sin = self._rope(cond_pos)
        img_cos, img_sin = self._rope(img_pos)

        img = self.x_embedder(self._patchify(latents.to(self.x_embedder.weight.dtype)))
        for block in self.noise_refiner:
            img = block(img, img_cos, img_sin, None, temb)

        cond = self.cond_proj(self.cond_norm(condition.to(self.cond_proj.weight.dtype)))
        if n_cond > 0:
            # A sample with no valid tokens may look at its (zeroed) padding so no softmax row is empty (NaN);
            # padded rows are zeroed after every block so they never leak NaN/garbage into later attention.
            refiner_mask = (condition_mask | ~condition_mask.any(1, keepdim=True)) if padded else None
            keep = condition_mask[..., None]
            for block in self.context_refiner:
                cond = block(cond, cond_cos, cond_sin, refiner_mask)
                if padded:
                    cond = torch.where(keep, cond, torch.zeros_like(cond))

        x = torch.cat([cond, img], dim=1)
        cos, sin = torch.cat([cond_cos, img_cos], dim=1), torch.cat([cond_sin, img_sin], dim=1)
        joint_mask = None
        if padded:
            joint_mask = torch.cat([condition_mask, condition_mask.new_ones(b, gh * gw)], dim=1)
        for block in self.layers:
            x = block(x, cos, sin, joint_mask, temb)

        img = x[:, n_cond:]
        scale = self.norm_out_scale(F.silu(temb))[:, None]
        img = F.layer_norm(img, (img.shape[-1],), eps=1e-6) * (1 + scale)
        return self._unpatchify(self.proj_out(img), h, w)
