"""MammothModa2's DiT: the Lumina2/OmniGen2-style single-stream transformer, with the checkpoint's module names.

Facts taken from the references (no code copied):
- Module tree and config fields: bytedance/mammothmoda ``mamoda2/mammothmoda2/model/mammothmoda2_dit/
  diffusion_transformer.py`` (``Transformer2DModel``) and ``block_lumina2.py``; vllm-project/vllm-omni
  ``vllm_omni/diffusion/models/mammoth_moda2/mammothmoda2_dit_model.py``. Config fields: patch_size, in_channels,
  out_channels, hidden_size, num_layers, num_refiner_layers, num_attention_heads, num_kv_heads, multiple_of,
  ffn_dim_multiplier, norm_eps, axes_dim_rope, axes_lens, text_feat_dim, timestep_scale, and is_image_embedder (the
  Qwen3-VL "Dev" release: ``mamoda2/.../diffusion_transformer.py`` 271, 308).
- ``time_caption_embed.caption_embedder`` is re-created by the pipeline as Sequential(RMSNorm(llm_hidden, eps 1e-5),
  Linear(llm_hidden -> hidden, bias)) (``modeling_mammothmoda2.py`` ``reinit_caption_embedder``), so its input width
  is the LLM hidden size, not ``text_feat_dim``.
- Dev layout (``is_image_embedder``; main ``mamoda2/mammothmoda2/model/modeling_mammothmoda2.py`` 212-221,
  ``block_lumina2.py`` 211-249, ``diffusion_transformer.py`` 622-638): ``time_caption_embed.image_embedder`` is a
  Q-Former from the LLM's width to the DiT's (refiner.py), sized by the root config's
  ``gen_image_condition_refiner_config``. The conditional branch's context is [caption_embedder(text rows) |
  image_embedder(image rows)] with the Q-Former's tokens always valid; unconditional branches get
  caption_embedder(negative rows) only. RoPE's caption length counts the Q-Former's tokens.
- Block: diffusers-style Attention (to_q/to_k/to_v without bias, to_out.0 without bias, per-head RMSNorm
  norm_q/norm_k, GQA), SwiGLU feed_forward (linear_1, linear_3 gate/up, linear_2 down; inner = 4*dim scaled by
  ffn_dim_multiplier and rounded up to multiple_of: 10240 for dim 2520), norm1 = LuminaRMSNormZero (linear
  min(dim,1024) -> 4*dim with bias; scale_msa, gate_msa, scale_mlp, gate_mlp; tanh gates) in modulated blocks and a
  plain RMSNorm in the context refiner, ffn_norm1, norm2, ffn_norm2.
- Refiners: ``noise_refiner`` and ``ref_image_refiner`` (modulated) and ``context_refiner`` (not modulated), each
  ``num_refiner_layers`` deep; ``ref_image_patch_embedder`` and ``image_index_embedding`` [5, hidden] embed the
  reference images of an edit (``reference_tokens``; diffusion_transformer.py 416-502), unused by text to image.
- ``norm_out``: LayerNorm without affine (eps 1e-6) scaled by 1 + linear_1(silu(temb)), then linear_2 to p*p*C.
- Timestep: diffusers ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=timestep_scale)`` then
  ``TimestepEmbedding(256 -> min(hidden, 1024))``; the timestep is cast to the model dtype first (t2i_utils.py
  ``processing``: ``t.expand(B).to(latents.dtype)``).
- RoPE (``rope_real.py``): real, interleaved-pair rotation, per-axis frequencies 1/theta^(2k/d), theta 10000, axes
  concatenated [axis0 | axis1 | axis2]. Caption token j gets position (j, j, j); image patch (r, c) gets
  (L_caption, r, c) where L_caption is the sample's number of valid condition tokens. Cos/sin are computed in
  float64 and stored in float32, as the reference tables are.
- Sequence: context refiner over the condition tokens, noise refiner over the image patches, then the joint
  sequence [valid condition tokens | image patches | padding] through ``layers``; output = the image rows.

ardit's own: positions are evaluated analytically (no ``axes_lens``-sized table, identical values inside the
table's range), and a batch may mix samples with different condition lengths: every position-wise op runs on the
padded batch while attention runs per sample on its valid rows only, so a padded batch gives bit-for-bit the same
result as running each sample alone on CPU (packed classifier-free guidance).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from torch import nn

from dit_service.model import qk_rope_kernel
from dit_service.model.layers import (
    FeedForward,
    RMSNorm,
    ffn_inner_dim,
    fused_on_cuda,
    gated_residual,
    modulated_norm,
)
from dit_service.model.refiner import ImageConditionRefiner
from servicekit import fp8_kernels
from servicekit.fp8 import quantize_linears_, shared_input

ROPE_THETA = 10000.0
FREQUENCY_EMBEDDING_SIZE = 256
MAX_REF_IMAGES = 5  # image_index_embedding rows


MIN_ROWS = 16


def _rows(n: int) -> int:
    return max(n, MIN_ROWS)


def rope_tables(positions: torch.Tensor, axes_dim: Sequence[int], theta: float = ROPE_THETA):
    """cos, sin [B, S, sum(axes_dim)/2] (float32) for integer positions [B, S, n_axes]."""
    parts = []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
        parts.append(positions[..., axis].to(torch.float64)[..., None] * freqs)
    angles = torch.cat(parts, dim=-1)
    return angles.cos().float(), angles.sin().float()


@fused_on_cuda
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent channel pairs of x [B, S, H, D] by the per-position angles; float32 math, dtype kept."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None], sin[:, :, None]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Self-attention with GQA, per-head QK RMSNorm and RoPE; parameter names as diffusers' Attention."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps=1e-5)
        self.norm_k = RMSNorm(self.head_dim, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(heads * self.head_dim, dim, bias=False), nn.Dropout(0.0)])

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int] | None,
        segments: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """x [B, S, dim]; ``lengths`` = valid leading rows per sample (None: all S), padded rows come out zero;
        or, packed, x [1, N, dim] holding several samples back to back: ``segments`` = (start, length) of each."""
        b, s, _ = x.shape
        q, k, v = shared_input(x, self.to_q, self.to_k, self.to_v)  # FP8: x quantized once for the three
        q, k = q.view(b, s, self.heads, self.head_dim), k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        if qk_rope_kernel.supports(q):  # the norm and the rotation in one pass per token
            q = qk_rope_kernel.qk_norm_rope(q, self.norm_q.weight, self.norm_q.eps, cos, sin)
            k = qk_rope_kernel.qk_norm_rope(k, self.norm_k.weight, self.norm_k.eps, cos, sin)
        else:
            q, k = apply_rope(self.norm_q(q), cos, sin), apply_rope(self.norm_k(k), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        gqa = self.kv_heads != self.heads
        if gqa and not q.is_cuda:  # query head h reads kv head h // (heads / kv_heads), as the references
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            gqa = False
        lengths = [s] * b if lengths is None else lengths
        # Attention outputs are put in [B, S, heads, D], the layout the output projection reads: a packed call's
        # segments are joined along S in it, so no reordering copy of the joined tensor follows.
        if segments is not None:  # packed samples: each attends over its own segment
            out = torch.cat(
                [F.scaled_dot_product_attention(
                    q[:, :, a : a + n], k[:, :, a : a + n], v[:, :, a : a + n], enable_gqa=gqa
                ).transpose(1, 2)
                 for a, n in segments], dim=1,
            )
        elif (b == 1 or q.is_cuda) and all(n == s for n in lengths):
            # Every row valid: one call for the batch (the CPU keeps one call per sample, see below; CUDA's default
            # mode promises no batch invariance, and the deterministic mode renders each image alone).
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).transpose(1, 2)
        else:
            # Each sample attends over its own valid rows only (the reference's varlen path), so neither padding
            # nor batch-mates can change a valid row's result, not even by rounding: the call for sample i is the
            # call a batch of one makes.
            out = q.new_zeros(b, s, self.heads, self.head_dim)
            for i, n in enumerate(lengths):
                if n > 0:
                    out[i : i + 1, :n] = F.scaled_dot_product_attention(
                        q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n], enable_gqa=gqa
                    ).transpose(1, 2)
        out = out.reshape(b, s, self.heads * self.head_dim)
        return self.to_out[1](self.to_out[0](out))


class RMSNormZero(nn.Module):
    """LuminaRMSNormZero: the timestep sets the attention input scale and the tanh gates."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.linear = nn.Linear(min(dim, 1024), 4 * dim, bias=True)
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, token_sample: torch.Tensor | None = None):
        """temb [>= B, D]: rows past x's batch are padding and are never read. Returns the scaled input and the
        modulation: gates shaped to broadcast over x, [B, 1, D]; or for packed samples (``token_sample`` [N]: the
        sample each token of x [1, N, D] belongs to) one row per sample, [>= B, D], which ``modulated_norm`` and
        ``gated_residual`` read through ``token_sample`` inside their fused kernel (no [N, D] copy per gate)."""
        mod = self.linear(F.silu(temb))
        if token_sample is None:
            mod = mod[: x.shape[0], None]
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=-1)
        h = modulated_norm(x, self.norm.weight, self.norm.eps, scale_msa, token_sample)
        return h, gate_msa, scale_mlp, gate_mlp


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, multiple_of, ffn_dim_multiplier, eps, modulation: bool):
        super().__init__()
        self.modulation = modulation
        self.attn = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, ffn_inner_dim(dim, multiple_of, ffn_dim_multiplier))
        self.norm1 = RMSNormZero(dim, eps) if modulation else RMSNorm(dim, eps)
        self.ffn_norm1 = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.ffn_norm2 = RMSNorm(dim, eps)

    def forward(self, x, cos, sin, lengths, temb=None, token_sample=None, segments=None):
        """``token_sample``/``segments``: x [1, N, D] packs several samples (see Attention and RMSNormZero)."""
        if self.modulation:
            h, gate_msa, scale_mlp, gate_mlp = self.norm1(x, temb, token_sample)
            attended = self.attn(h, cos, sin, lengths, segments)
            x = gated_residual(x, gate_msa, attended, self.norm2.weight, self.norm2.eps, token_sample)
            out = self.feed_forward(modulated_norm(x, self.ffn_norm1.weight, self.ffn_norm1.eps, scale_mlp, token_sample))
            return gated_residual(x, gate_mlp, out, self.ffn_norm2.weight, self.ffn_norm2.eps, token_sample)
        x = x + self.norm2(self.attn(self.norm1(x), cos, sin, lengths, segments))
        return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))


class TimeCaptionEmbed(nn.Module):
    """``time_caption_embed``: sinusoidal timestep -> MLP, the condition projection (caption_embedder) and, in the Dev
    layout, the Q-Former image embedder (``image_embedder``: image-condition rows in the LLM's width -> query tokens in
    the DiT's; block_lumina2.py 211-224, replaced at load by modeling_mammothmoda2.py 212-221)."""

    def __init__(
        self, hidden_size: int, condition_dim: int, norm_eps: float, timestep_scale: float,
        image_embedder_config: dict | None = None,
    ):
        """``image_embedder_config``: the root config's ``gen_image_condition_refiner_config`` when the DiT holds the
        Q-Former (``is_image_embedder``); None: no image embedder (Preview)."""
        super().__init__()
        self.time_proj = Timesteps(
            num_channels=FREQUENCY_EMBEDDING_SIZE,
            flip_sin_to_cos=True,
            downscale_freq_shift=0.0,
            # diffusers annotates this int, but passes it on to get_timestep_embedding's float ``scale``
            scale=timestep_scale,  # type: ignore[arg-type]
        )
        self.timestep_embedder = TimestepEmbedding(in_channels=FREQUENCY_EMBEDDING_SIZE, time_embed_dim=min(hidden_size, 1024))
        # Upstream re-creates this with the LLM's hidden size (and RMSNorm eps 1e-5 regardless of norm_eps).
        self.caption_embedder = nn.Sequential(RMSNorm(condition_dim, eps=1e-5), nn.Linear(condition_dim, hidden_size, bias=True))
        self.image_embedder: nn.Module | None = None
        if image_embedder_config is not None:
            self.image_embedder = ImageConditionRefiner.image_embedder(image_embedder_config, condition_dim, hidden_size)

    def timestep_embedding(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(self.time_proj(timestep).to(dtype))

    def forward(self, timestep: torch.Tensor, condition: torch.Tensor, dtype: torch.dtype):
        return self.timestep_embedding(timestep, dtype), self.caption_embedder(condition)


class LayerNormContinuous(nn.Module):
    """``norm_out``: affine-free LayerNorm scaled by the timestep, then the patch projection."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(min(dim, 1024), dim, bias=True)
        self.norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.linear_2 = nn.Linear(dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear_1(F.silu(temb).to(x.dtype))[: x.shape[0]]  # temb may carry padding rows
        return self.linear_2(self.norm(x) * (1 + scale)[:, None, :])


class MammothDiT(nn.Module):
    """forward(latents [B,C,h,w], timestep t in [0,1] (0 = noise) [B], condition [B,L,D], lengths) -> velocity.

    The condition a step takes (``step_condition_dim`` wide): the LLM's hidden states (D = llm_hidden), which the
    step's caption embedder projects (Preview layout); or, with ``is_image_embedder`` (Dev layout), the context
    already in the DiT's width (D = hidden_size): ``context`` computes it once per request from the text rows
    (caption embedder) and the image rows (Q-Former), and every step reuses it."""

    CONFIG_FIELDS = (
        "patch_size", "in_channels", "out_channels", "hidden_size", "num_layers", "num_refiner_layers",
        "num_attention_heads", "num_kv_heads", "multiple_of", "ffn_dim_multiplier", "norm_eps", "axes_dim_rope",
        "axes_lens", "text_feat_dim", "timestep_scale", "is_image_embedder",
    )

    def __init__(
        self,
        condition_dim: int,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2304,
        num_layers: int = 26,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 24,
        num_kv_heads: int = 8,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: Sequence[int] = (32, 32, 32),
        axes_lens: Sequence[int] = (300, 512, 512),
        text_feat_dim: int = 1024,
        timestep_scale: float = 1.0,
        is_image_embedder: bool = False,
        image_embedder_config: dict | None = None,
    ):
        """``image_embedder_config``: with ``is_image_embedder``, the root config's
        ``gen_image_condition_refiner_config`` (the Q-Former's size; None: its defaults, 128 queries and 2 layers)."""
        super().__init__()
        # Defaults are the reference class's; a checkpoint's gen_dit_config sets them all.
        if hidden_size // num_attention_heads != sum(axes_dim_rope):
            raise ValueError(
                f"hidden_size // num_attention_heads ({hidden_size // num_attention_heads}) must equal "
                f"sum(axes_dim_rope) ({sum(axes_dim_rope)})"
            )
        if any(d % 2 for d in axes_dim_rope) or num_attention_heads % num_kv_heads:
            raise ValueError("RoPE axes need even sizes and num_attention_heads must be a multiple of num_kv_heads")
        if image_embedder_config is not None and not is_image_embedder:
            raise ValueError("image_embedder_config sizes the Q-Former inside the DiT: it needs is_image_embedder")
        del text_feat_dim  # replaced by the LLM hidden size (reinit_caption_embedder)
        self.patch_size, self.in_channels = patch_size, in_channels
        self.out_channels = out_channels or in_channels
        self.hidden_size = hidden_size
        self.is_image_embedder = bool(is_image_embedder)
        self.axes_dim_rope = tuple(int(d) for d in axes_dim_rope)
        self.axes_lens = tuple(int(n) for n in axes_lens)
        patch_dim = patch_size * patch_size * in_channels

        def blocks(n: int, modulation: bool) -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(hidden_size, num_attention_heads, num_kv_heads, multiple_of, ffn_dim_multiplier,
                                 norm_eps, modulation)
                for _ in range(n)
            )

        self.x_embedder = nn.Linear(patch_dim, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch_dim, hidden_size)
        # Dev: the Q-Former lives in time_caption_embed (block_lumina2.py 211-224; modeling_mammothmoda2.py 212-221).
        embedder_config = (image_embedder_config or {}) if self.is_image_embedder else None
        self.time_caption_embed = TimeCaptionEmbed(hidden_size, condition_dim, norm_eps, timestep_scale, embedder_config)
        self.noise_refiner = blocks(num_refiner_layers, True)
        self.ref_image_refiner = blocks(num_refiner_layers, True)
        self.context_refiner = blocks(num_refiner_layers, False)
        self.layers = blocks(num_layers, True)
        self.norm_out = LayerNormContinuous(hidden_size, patch_size * patch_size * self.out_channels)
        self.image_index_embedding = nn.Parameter(torch.zeros(MAX_REF_IMAGES, hidden_size))
        # Joint layers over packed samples (no padding rows) when a call holds several: set on CUDA, where batch
        # invariance is not promised by the default mode; the CPU keeps the padded layout (bit-exact invariance).
        self.pack_samples = False

    @classmethod
    def from_config(cls, config: dict, condition_dim: int, image_embedder_config: dict | None = None) -> MammothDiT:
        """``image_embedder_config``: the root config's ``gen_image_condition_refiner_config``, for a DiT with
        ``is_image_embedder`` (Dev)."""
        known = {k: v for k, v in config.items() if not k.startswith("_")}
        unknown = set(known) - set(cls.CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"gen_dit_config has fields this DiT does not know: {sorted(unknown)}")
        return cls(condition_dim=condition_dim, image_embedder_config=image_embedder_config, **known)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.weight.dtype

    @property
    def condition_dim(self) -> int:
        """Width of the AR's condition rows: the caption embedder's (and the Q-Former's) input, the LLM hidden size."""
        projection = self.time_caption_embed.caption_embedder[1]
        assert isinstance(projection, nn.Linear)  # caption_embedder is Sequential(RMSNorm, Linear)
        return projection.in_features

    @property
    def step_condition_dim(self) -> int:
        """Width of the condition ``forward`` takes: the LLM's (Preview), or the DiT's for the Dev layout's context."""
        return self.hidden_size if self.is_image_embedder else self.condition_dim

    def context(self, text: torch.Tensor | None, image: torch.Tensor | None) -> torch.Tensor:
        """The Dev layout's context for one request: [caption_embedder(text) | image_embedder(image)], [L + Q, hidden]
        in the model dtype (diffusion_transformer.py 622-638). ``text`` [L, llm_hidden] (None: no text part; 0 rows:
        an empty one), ``image`` [M >= 1, llm_hidden] (None: no Q-Former tokens, as every unconditional branch,
        t2i_utils.py 228-244 and 253-260). The Q-Former's tokens are always valid (mask of ones, 630-634), and the
        rows are one sample's, so nothing is padded (the released code puts a padded text batch's pads inside the
        first cap_len rows; one request at a time it has none).

        The released code runs the Q-Former inside every DiT call (block_lumina2.py 244-245, from
        diffusion_transformer.py 622-628, once per step and branch: t2i_utils.py 214-223); its output depends on
        the request's image condition alone, so it is computed here once per request (and the caption embedding
        with it) and the steps reuse the result."""
        if not self.is_image_embedder:
            raise ValueError("context is the Dev layout's (is_image_embedder); this DiT embeds its condition each step")
        embed = self.time_caption_embed
        dtype, device = self.dtype, self.x_embedder.weight.device
        parts = []
        if text is not None:
            parts.append(embed.caption_embedder(text.to(device=device, dtype=dtype)))
        if image is not None:
            if image.ndim != 2 or image.shape[0] == 0:
                raise ValueError(
                    "the Q-Former needs at least one image-condition row [positions >= 1, llm_hidden]; got "
                    f"{tuple(image.shape)}"
                )
            assert embed.image_embedder is not None  # built with is_image_embedder
            parts.append(embed.image_embedder(image.to(device=device, dtype=dtype)[None])[0])
        if not parts:
            return torch.zeros(0, self.hidden_size, device=device, dtype=dtype)
        return torch.cat(parts, dim=0)

    # -- token layout -------------------------------------------------------------------------------------------

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, (h/p)*(w/p), p*p*C], channel-last inside a patch ("(p1 p2 c)")."""
        b, c, h, w = latents.shape
        p = self.patch_size
        x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (h // p) * (w // p), p * p * c)

    def _unpatchify(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, p, c = tokens.shape[0], self.patch_size, self.out_channels
        x = tokens.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, c, h, w)

    def _packed_layers(self, x, cos, sin, seq_lengths: list[int], temb) -> torch.Tensor:
        """The joint layers over the samples' valid rows back to back ([1, sum(lengths), D]): no matmul work on
        padding (a CFG pair pads its short unconditional branch to the conditional one's length otherwise)."""
        b, total, _ = x.shape
        starts = [sum(seq_lengths[:i]) for i in range(b)]
        segments = list(zip(starts, seq_lengths, strict=True))
        flat = lambda t: torch.cat([t[i, :n] for i, n in enumerate(seq_lengths)])[None]  # noqa: E731
        # Built on the device from Python ints: no host-to-device copy and no sync (a CUDA graph can hold it).
        token_sample = torch.cat([torch.full((n,), i, device=x.device) for i, n in enumerate(seq_lengths)])
        h, cos, sin = flat(x), flat(cos), flat(sin)
        for layer in self.layers:
            h = layer(h, cos, sin, None, temb, token_sample, segments)
        out = x.new_zeros(b, total, x.shape[-1])
        for i, (a, n) in enumerate(segments):
            out[i, :n] = h[0, a : a + n]
        return out

    # -- step caching -------------------------------------------------------------------------------------------

    def cache_indicator(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """What step caching compares between steps (TeaCache's indicator): the first modulated block's
        timestep-modulated input, the image tokens after the patch embedding and the block's adaLN scale, for one
        sample (latents [1, C, h, w], timestep [1]); float32 [n_img, D].

        It depends on the sample's own latents and time only (not on its condition, nor on anything else in a
        batch), so both CFG branches of an image share it and a decision made on it is the image's alone. Padded
        to the same row counts as ``forward`` for the same kernels."""
        if latents.shape[0] != 1:
            raise ValueError(f"cache_indicator takes one sample; got a batch of {latents.shape[0]}")
        device, dtype = latents.device, self.dtype
        t = F.pad(timestep.to(device=device, dtype=dtype).reshape(-1)[:1], (0, _rows(1) - 1))
        temb = self.time_caption_embed.timestep_embedding(t, dtype)
        tokens = self._patchify(latents.to(dtype))
        n_img = tokens.shape[1]
        img = self.x_embedder(F.pad(tokens, (0, 0, 0, _rows(n_img) - n_img)))
        first = next(layer for layer in (*self.noise_refiner, *self.layers) if layer.modulation)
        modulated, *_ = first.norm1(img, temb)
        return modulated[0, :n_img].float()

    # -- forward --------------------------------------------------------------------------------------------------

    def reference_positions(self, caption_length: int, sizes: Sequence[tuple[int, int]]) -> tuple[list[torch.Tensor], int]:
        """RoPE position ids [n_j, 3] of each reference's tokens and the target's axis-0 position (rope_real.py
        217-258): reference j at axis 0 = caption_length + sum over i < j of max(Ht_i, Wt_i), rows and columns from 0
        on axes 1 and 2; the target at caption_length + the sum over all references. ``sizes``: the references'
        token grids (Ht, Wt)."""
        shift = caption_length
        positions = []
        for gh, gw in sizes:
            rows = torch.arange(gh).repeat_interleave(gw)
            cols = torch.arange(gw).repeat(gh)
            positions.append(torch.stack([torch.full((gh * gw,), shift), rows, cols], dim=-1))
            shift += max(gh, gw)
        return positions, shift

    def reference_tokens(
        self, references: Sequence[torch.Tensor], timestep: torch.Tensor, caption_length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """One sample's reference images as joint-sequence tokens (diffusion_transformer.py 416-502, 504-584): each
        reference latent [C, h, w] patchified like the target ("c (h p) (w p) -> (h w) (p p c)"), through
        ``ref_image_patch_embedder``, plus ``image_index_embedding[j]``, then through ``ref_image_refiner`` (modulated
        by the sample's timestep ``timestep`` [1]) with its own RoPE, one reference at a time (the released code
        batches them with a mask per reference: the same attention). Returns the tokens [R, D] (the references back
        to back), their cos/sin [R, rope/2] and the target's axis-0 position.

        Computed for the sample alone (its own timestep embedding, token tensors padded to MIN_ROWS), so a sample's
        reference tokens never depend on its batch-mates."""
        if len(references) > self.image_index_embedding.shape[0]:
            raise ValueError(f"at most {self.image_index_embedding.shape[0]} reference images; got {len(references)}")
        p, dtype = self.patch_size, self.dtype
        device = self.x_embedder.weight.device
        sizes = []
        for j, ref in enumerate(references):
            if ref.ndim != 3 or ref.shape[0] != self.in_channels or ref.shape[1] % p or ref.shape[2] % p:
                raise ValueError(f"reference latent {j} must be [{self.in_channels}, h, w] with h and w multiples of "
                                 f"{p}; got {tuple(ref.shape)}")
            sizes.append((ref.shape[1] // p, ref.shape[2] // p))
        positions, target_shift = self.reference_positions(caption_length, sizes)
        t = F.pad(timestep.to(device=device, dtype=dtype).reshape(-1)[:1], (0, _rows(1) - 1))
        temb = self.time_caption_embed.timestep_embedding(t, dtype)
        tokens, coses, sines = [], [], []
        for j, (ref, pos) in enumerate(zip(references, positions, strict=True)):
            n = pos.shape[0]
            pad = _rows(n) - n
            x = self.ref_image_patch_embedder(F.pad(self._patchify(ref[None].to(device=device, dtype=dtype)), (0, 0, 0, pad)))
            x = x + self.image_index_embedding[j].to(dtype)
            cos, sin = rope_tables(pos.to(device)[None], self.axes_dim_rope)
            pcos, psin = F.pad(cos, (0, 0, 0, pad)), F.pad(sin, (0, 0, 0, pad))
            for layer in self.ref_image_refiner:
                x = layer(x, pcos, psin, [n] if pad else None, temb)
            tokens.append(x[0, :n])
            coses.append(cos[0])
            sines.append(sin[0])
        return torch.cat(tokens), torch.cat(coses), torch.cat(sines), target_shift

    def forward(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        condition: torch.Tensor,
        condition_lengths: Sequence[int] | None = None,
        references: Sequence[Sequence[torch.Tensor] | None] | None = None,
    ) -> torch.Tensor:
        """latents [B,C,h,w], timestep [B], condition [B,L,step_condition_dim]; sample i uses condition[i, :lengths[i]]
        (in the Dev layout the rows are the context, Q-Former tokens included: RoPE's caption length counts them).

        ``references``: per sample, None or its reference latents [C, h_j, w_j] (an edit's cond and ref branches):
        the sample's joint sequence is then [context | ref_1 .. ref_K | target] (``reference_tokens``), the target's
        axis-0 RoPE position moves past the references, and the prediction is the last n_img valid tokens."""
        b, _, h, w = latents.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"latent size {h}x{w} is not a multiple of patch_size {p}")
        gh, gw = h // p, w // p
        n_img = gh * gw
        max_cond = condition.shape[1]
        lengths = [max_cond] * b if condition_lengths is None else [int(n) for n in condition_lengths]
        if len(lengths) != b or any(not 0 <= n <= max_cond for n in lengths):
            raise ValueError(f"condition_lengths {lengths} do not fit a batch of {b} with {max_cond} positions")
        if condition.shape[-1] != self.step_condition_dim:
            raise ValueError(f"condition rows must be {self.step_condition_dim} wide; got {condition.shape[-1]}")
        device, dtype = latents.device, self.dtype

        timestep = timestep.to(device=device, dtype=dtype).reshape(-1)
        if timestep.shape[0] == 1:
            timestep = timestep.expand(b)
        elif timestep.shape[0] != b:
            raise ValueError(f"timestep must have 1 or {b} values; got {timestep.shape[0]}")
        # Every sample has its own time (step-level batching mixes steps). The time embedding and every modulation
        # linear run on at least MIN_ROWS rows (zero padding, sliced off), for the same reason as the token tensors:
        # a row's result must not depend on how many other samples share the call.
        timestep = F.pad(timestep, (0, _rows(b) - b))
        # Token tensors get at least MIN_ROWS rows (zero padding that attention never reads): CPU GEMMs take a
        # different kernel for a handful of rows, and a padded CFG batch must see the same kernels as a batch of one.
        cond_rows = _rows(max_cond) if max_cond > 0 else 0
        condition = F.pad(condition.to(device=device, dtype=dtype), (0, 0, 0, cond_rows - max_cond))
        if self.is_image_embedder:  # the context, embedded once per request (``context``)
            temb, cond = self.time_caption_embed.timestep_embedding(timestep, dtype), condition
        else:
            temb, cond = self.time_caption_embed(timestep, condition, dtype)

        if references is not None and len(references) != b:
            raise ValueError(f"references must have one entry per sample ({b}); got {len(references)}")
        refs = [None] * b if references is None else [r if r else None for r in references]
        # Reference tokens per sample ([R_i, D], their cos/sin) and the target's axis-0 position (rope_real.py 217-258).
        ref_parts = [None if r is None else self.reference_tokens(r, timestep[i : i + 1], lengths[i])
                     for i, r in enumerate(refs)]
        ref_lengths = [0 if part is None else part[0].shape[0] for part in ref_parts]
        shifts = [n if part is None else part[3] for n, part in zip(lengths, ref_parts, strict=True)]
        prefixes = [n + r for n, r in zip(lengths, ref_lengths, strict=True)]  # rows before the target's

        # Positions (rope_real.py): caption j -> (j, j, j); image patch -> (L_i [+ references], row, col).
        cap_pos = torch.arange(cond_rows, device=device)[None, :, None].expand(b, cond_rows, 3)
        rows = torch.arange(gh, device=device).repeat_interleave(gw)
        cols = torch.arange(gw, device=device).repeat(gh)
        same_length = len(set(prefixes)) == 1
        if len(set(shifts)) == 1:
            shift = torch.full((b, n_img), shifts[0], device=device)
        else:
            shift = torch.stack([torch.full((n_img,), n, device=device) for n in shifts])
        img_pos = torch.stack([shift, rows.expand(b, -1), cols.expand(b, -1)], dim=-1)
        cap_cos, cap_sin = rope_tables(cap_pos, self.axes_dim_rope)
        img_cos, img_sin = rope_tables(img_pos, self.axes_dim_rope)

        if max_cond > 0:
            for layer in self.context_refiner:
                cond = layer(cond, cap_cos, cap_sin, lengths)

        img_rows = _rows(n_img)
        img = self.x_embedder(F.pad(self._patchify(latents.to(dtype)), (0, 0, 0, img_rows - n_img)))
        img_lengths = None if img_rows == n_img else [n_img] * b
        pad_img = lambda t: F.pad(t, (0, 0, 0, img_rows - n_img))  # noqa: E731
        for layer in self.noise_refiner:
            img = layer(img, pad_img(img_cos), pad_img(img_sin), img_lengths, temb)

        # Joint sequence per sample: [its valid condition rows | its reference rows | image rows | padding].
        seq_lengths = [n + n_img for n in prefixes]
        total = _rows(max(seq_lengths))
        no_refs = not any(ref_lengths)
        if no_refs and all(n == cond_rows for n in lengths) and img_rows == n_img and total == cond_rows + n_img:
            x = torch.cat([cond, img], dim=1)
            cos, sin = torch.cat([cap_cos, img_cos], dim=1), torch.cat([cap_sin, img_sin], dim=1)
        elif len(set(lengths)) == 1 and len(set(ref_lengths)) == 1:
            # One layout for every sample (a CFG branch's rows, a training bucket): the sequence is one concatenation
            # instead of a copy per sample; the same values as below.
            n, pad = lengths[0], (0, 0, 0, total - seq_lengths[0])
            refs_of = [part[:3] for part in ref_parts if part is not None]  # all samples' or none
            ref_x, ref_cos, ref_sin = ([torch.stack(t)] for t in zip(*refs_of, strict=True)) if refs_of else ([], [], [])
            x = F.pad(torch.cat([cond[:, :n], *ref_x, img[:, :n_img]], dim=1), pad)
            cos = F.pad(torch.cat([cap_cos[:, :n], *ref_cos, img_cos], dim=1), pad)
            sin = F.pad(torch.cat([cap_sin[:, :n], *ref_sin, img_sin], dim=1), pad)
        else:
            x = img.new_zeros(b, total, self.hidden_size)
            cos = img_cos.new_zeros(b, total, img_cos.shape[-1])
            sin = torch.zeros_like(cos)
            for i, (n, a) in enumerate(zip(lengths, prefixes, strict=True)):
                x[i, :n], x[i, a : a + n_img] = cond[i, :n], img[i, :n_img]
                cos[i, :n], cos[i, a : a + n_img] = cap_cos[i, :n], img_cos[i]
                sin[i, :n], sin[i, a : a + n_img] = cap_sin[i, :n], img_sin[i]
                part = ref_parts[i]
                if part is not None:
                    x[i, n:a], cos[i, n:a], sin[i, n:a] = part[0], part[1], part[2]
        if self.pack_samples and b > 1 and len(set(seq_lengths)) > 1:  # equal lengths: no padding to leave out
            x = self._packed_layers(x, cos, sin, seq_lengths, temb)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, seq_lengths, temb)

        x = self.norm_out(x, temb)
        if same_length:  # the prediction: the last n_img valid tokens (diffusion_transformer.py 751-761)
            out = x[:, prefixes[0] : prefixes[0] + n_img]
        else:
            out = torch.stack([x[i, a : a + n_img] for i, a in enumerate(prefixes)])
        return self._unpatchify(out, h, w)


#: The linears of a transformer block that FP8 covers: attention projections and the SwiGLU feed-forward.
BLOCK_FP8_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                     "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3")


def quantize_fp8_(model: MammothDiT) -> int:
    """FP8 matmuls (e4m3 weights with per-output-channel scales, per-token dynamic activation scales, bf16 out) for
    every transformer block's attention projections and feed-forward, in place; returns how many linears.

    These hold ~all of a denoise step's FLOPs (at 1024x1024 each of ~8k tokens passes 20+ blocks). Left in bf16:
    the patch embedder (K = 64), the caption projection (once per step over the condition rows, well under 1% of a
    step; in the Dev layout once per request, with the Q-Former image embedder), the timestep embedder, the
    modulation linears and norm_out (a few rows each: bound by their weight reads, not by tensor-core rate) and
    attention itself (softmax(QK^T)V stays bf16 SDPA)."""
    names = [f"{group}.{i}.{leaf}" for group in ("context_refiner", "noise_refiner", "ref_image_refiner", "layers")
             for i in range(len(getattr(model, group))) for leaf in BLOCK_FP8_LINEARS]
    return quantize_linears_(model, names, "dynamic", fp8_kernels.quantize_rows)


def dit_parameter_count(config: dict, condition_dim: int, image_embedder_config: dict | None = None) -> int:
    """Parameters of the DiT a gen_dit_config describes (its Q-Former included in the Dev layout), without allocating
    it (meta device)."""
    with torch.device("meta"):
        model = MammothDiT.from_config(config, condition_dim, image_embedder_config)
    return sum(p.numel() for p in model.parameters())

