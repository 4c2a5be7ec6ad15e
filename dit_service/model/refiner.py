"""The Q-Former that maps a variable number of image-condition rows to a fixed number of query tokens, in both places
the MammothModa2 releases keep it.

- Preview: beside the DiT, ``gen_image_condition_refiner`` (SimpleQFormerImageRefiner): input and output in the LLM's
  width; its output joins the text condition before the DiT's caption embedder. Facts (no code copied):
  vllm-project/vllm-omni ``vllm_omni/diffusion/models/mammoth_moda2/mammothmoda2_dit_model.py``
  (``SimpleQFormerImageRefiner``) and ``pipeline_mammothmoda2_dit.py``; bytedance/mammothmoda qwen25vl
  ``mammothmoda2/model/modeling_mammothmoda2.py`` 139-142 (built with ``hidden_size = llm hidden`` and
  ``**gen_image_condition_refiner_config`` when that config is not null) and ``mammothmoda2/utils/t2i_utils.py``
  (``encode_full_prompts``: applied to the image condition only, key_padding_mask = ~mask; fully valid output).
- Dev: inside the DiT, ``gen_transformer.time_caption_embed.image_embedder`` (SimpleQFormerImageEmbedder): input in
  the LLM's width, output in the DiT's, so it bypasses the caption embedder (``image_embedder``). Facts: bytedance/
  mammothmoda main ``mamoda2/mammothmoda2/model/mammothmoda2_dit/image_refiner.py`` 88-186 and
  ``mamoda2/mammothmoda2/model/modeling_mammothmoda2.py`` 212-221 (``reinit_image_embedder``).

Structure (the same in both): ``input_proj`` = Sequential(RMSNorm(in), Linear(in -> hidden, bias)); learnable
``query`` [1, Q, hidden]; ``layers.N`` = {ln_q1, self_attn (nn.MultiheadAttention, batch_first), ln_q2, cross_attn
(queries attend to the projected inputs), ln_ffn, ffn (SwiGLU, inner 4*hidden rounded up to 256)}; pre-norm residuals.
Heads: the given number if it divides hidden, else the divisor of hidden (at most 128) nearest to round(hidden / 128)
(``_choose_valid_num_heads``, image_refiner.py 146-159). Output [B, Q, hidden].
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from dit_service.model.layers import FeedForward, RMSNorm, ffn_inner_dim

#: The ``gen_image_condition_refiner_config`` keys a Dev checkpoint may set: the released ``reinit_image_embedder``
#: splats that dict into SimpleQFormerImageEmbedder beside its own input_dim, hidden_size and num_heads
#: (modeling_mammothmoda2.py 216-220), so only the constructor's other arguments can come from it. Which of them the
#: released config.json sets is not published (UNVERIFIED).
DEV_CONFIG_FIELDS = ("num_queries", "num_layers", "dropout", "norm_eps")
#: Keys the released code passes itself: a config that also sets one is a TypeError (a repeated keyword) there.
DEV_CODE_FIELDS = ("input_dim", "hidden_size", "num_heads")


def choose_num_heads(hidden_size: int, proposed: int | None, preferred_head_dim: int = 128) -> int:
    if proposed is None:
        proposed = max(1, hidden_size // preferred_head_dim)
    if proposed > 0 and hidden_size % proposed == 0:
        return proposed
    target = max(1, round(hidden_size / preferred_head_dim))
    divisors = [d for d in range(1, min(128, hidden_size) + 1) if hidden_size % d == 0]
    return min(divisors, key=lambda d: (abs(d - target), -d))


class QFormerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float, dropout: float):
        super().__init__()
        self.ln_q1 = RMSNorm(hidden, eps)
        self.self_attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.ln_q2 = RMSNorm(hidden, eps)
        self.cross_attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.ln_ffn = RMSNorm(hidden, eps)
        self.ffn = FeedForward(hidden, ffn_inner_dim(hidden, 256, None))


class ImageConditionRefiner(nn.Module):
    """``hidden_size``: the input width (the LLM's); ``output_hidden_size``: the query width (the input's when None)."""

    CONFIG_FIELDS = ("output_hidden_size", "num_queries", "num_layers", "num_heads", "dropout", "norm_eps")

    def __init__(
        self,
        hidden_size: int,
        output_hidden_size: int | None = None,
        num_queries: int = 128,
        num_layers: int = 2,
        num_heads: int | None = None,
        dropout: float = 0.0,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        hidden = output_hidden_size or hidden_size
        self.input_size, self.hidden_size, self.num_queries = hidden_size, hidden, num_queries
        self.num_heads = choose_num_heads(hidden, num_heads)
        self.input_proj = nn.Sequential(RMSNorm(hidden_size, norm_eps), nn.Linear(hidden_size, hidden, bias=True))
        self.query = nn.Parameter(torch.zeros(1, num_queries, hidden))
        self.layers = nn.ModuleList(QFormerLayer(hidden, self.num_heads, norm_eps, dropout) for _ in range(num_layers))

    @classmethod
    def from_config(cls, config: dict, llm_hidden_size: int) -> ImageConditionRefiner:
        """Preview's refiner beside the DiT, in the LLM's width."""
        unknown = set(config) - set(cls.CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"gen_image_condition_refiner_config has unknown fields: {sorted(unknown)}")
        return cls(hidden_size=llm_hidden_size, **config)

    @classmethod
    def image_embedder(cls, config: dict, llm_hidden_size: int, dit_hidden_size: int) -> ImageConditionRefiner:
        """Dev's Q-Former inside the DiT: from the LLM's width to the DiT's, num_heads = max(1, dit hidden // 128)
        (modeling_mammothmoda2.py 216-220), the rest from the root config's ``gen_image_condition_refiner_config``."""
        if not isinstance(config, dict):
            raise ValueError(
                "gen_image_condition_refiner_config must be an object for a checkpoint whose DiT holds the Q-Former "
                f"(gen_dit_config.is_image_embedder); got {config!r}. The released code splats it into the Q-Former "
                "(modeling_mammothmoda2.py 220); {} gives its defaults (128 queries, 2 layers)"
            )
        passed = sorted(set(config) & set(DEV_CODE_FIELDS))
        if passed:
            raise ValueError(
                f"gen_image_condition_refiner_config sets {', '.join(passed)}, which the released code passes itself for "
                "the Q-Former inside the DiT (input_dim = the LLM's hidden size, hidden_size = the DiT's, num_heads = "
                "max(1, hidden_size // 128); modeling_mammothmoda2.py 216-219): remove them"
            )
        unknown = sorted(set(config) - set(DEV_CONFIG_FIELDS))
        if unknown:
            raise ValueError(
                f"gen_image_condition_refiner_config has fields the Q-Former inside the DiT does not take: {unknown}; "
                f"accepted: {', '.join(DEV_CONFIG_FIELDS)}"
            )
        return cls(hidden_size=llm_hidden_size, output_hidden_size=dit_hidden_size,
                   num_heads=max(1, dit_hidden_size // 128), **config)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, in], padding_mask [B, L] (True = padding) -> [B, num_queries, hidden]."""
        kv = self.input_proj(x)
        q = self.query.expand(x.shape[0], -1, -1).to(kv.dtype)
        for layer in cast("Iterable[QFormerLayer]", self.layers):  # nn.ModuleList yields plain Modules
            h = layer.ln_q1(q)
            q = q + layer.self_attn(h, h, h, need_weights=False)[0]
            h = layer.ln_q2(q)
            q = q + layer.cross_attn(h, kv, kv, need_weights=False, key_padding_mask=padding_mask)[0]
            q = q + layer.ffn(layer.ln_ffn(q))
        return q
