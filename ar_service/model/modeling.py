"""MammothModa2-style AR: a Qwen2 decoder whose generation-vocabulary positions use expert weights.

Routing is by INPUT token id (hard router, bytedance/mammothmoda): ids >= gen_vocab_start_index take
`gen_embed_tokens`, `gen_mlp` and/or `gen_{q,k,v,o}_proj` (per moe_type and its layer range); text ids
take the ordinary Qwen2 weights. Logits are [lm_head | gen_head] concatenated over the total vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2MLP,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)

from ar_service.model.configuration import MammothARConfig


class KVCache:
    """Per-request key/value store, one preallocated buffer per layer that grows by doubling."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.length = 0
        self._k: list[torch.Tensor | None] = []
        self._v: list[torch.Tensor | None] = []

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, kv_heads, T, D] after the cached ones; returns views of everything so far."""
        while len(self._k) <= layer:
            self._k.append(None)
            self._v.append(None)
        start, end = self.length, self.length + k.shape[2]
        buf_k, buf_v = self._k[layer], self._v[layer]
        if buf_k is None or buf_k.shape[2] < end:
            size = max(end, self.capacity, 2 * (0 if buf_k is None else buf_k.shape[2]))
            new_k = k.new_empty(k.shape[0], k.shape[1], size, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], size, v.shape[3])
            if buf_k is not None:
                new_k[:, :, :start] = buf_k[:, :, :start]
                new_v[:, :, :start] = buf_v[:, :, :start]
            self._k[layer], self._v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, start:end] = k
        buf_v[:, :, start:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def advance(self, tokens: int) -> None:
        """Called once per forward, after every layer appended its `tokens` new positions."""
        self.length += tokens


def _route(x: torch.Tensor, route: str, is_gen: torch.Tensor, text_fn: Callable, gen_fn: Callable) -> torch.Tensor:
    """Hard routing per position; the all-text / all-gen fast paths avoid gathers during decode."""
    if route == "text":
        return text_fn(x)
    if route == "gen":
        return gen_fn(x)
    text_out = text_fn(x[~is_gen])
    out = x.new_empty(*x.shape[:-1], text_out.shape[-1])
    out[~is_gen] = text_out
    out[is_gen] = gen_fn(x[is_gen])
    return out


def _projections(config: MammothARConfig, prefix: str = "") -> dict[str, nn.Linear]:
    h, d = config.hidden_size, config.head_dim
    return {
        f"{prefix}q_proj": nn.Linear(h, config.num_attention_heads * d, bias=True),
        f"{prefix}k_proj": nn.Linear(h, config.num_key_value_heads * d, bias=True),
        f"{prefix}v_proj": nn.Linear(h, config.num_key_value_heads * d, bias=True),
        f"{prefix}o_proj": nn.Linear(config.num_attention_heads * d, h, bias=False),
    }


class MammothAttention(nn.Module):
    """Qwen2 GQA attention (q/k/v biased, o unbiased) with optional generation-expert projections."""

    def __init__(self, config: MammothARConfig, layer_idx: int, experts: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.experts = experts
        for name, linear in _projections(config).items():
            setattr(self, name, linear)
        if experts:
            for name, linear in _projections(config, "gen_").items():
                setattr(self, name, linear)

    def _proj(self, name: str, x: torch.Tensor, route: str, is_gen: torch.Tensor) -> torch.Tensor:
        text = getattr(self, name)
        if not self.experts:
            return text(x)
        return _route(x, route, is_gen, text, getattr(self, f"gen_{name}"))

    def forward(self, x, cos, sin, route, is_gen, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self._proj("q_proj", x, route, is_gen).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self._proj("k_proj", x, route, is_gen).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self._proj("v_proj", x, route, is_gen).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v)
        if t == 1:
            mask, causal = None, False  # one new query sees every cached key
        elif past == 0:
            mask, causal = None, True
        else:  # a chunk after a cached prefix: query i sees keys [0, past + i]
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self._proj("o_proj", out, route, is_gen)


class MammothDecoderLayer(nn.Module):
    """Pre-norm Qwen2 block; `gen_mlp` exists only on layers the moe_type range selects."""

    def __init__(self, config: MammothARConfig, layer_idx: int) -> None:
        super().__init__()
        moe, in_range = config.moe, layer_idx in config.moe_layers
        self.self_attn = MammothAttention(config, layer_idx, experts=in_range and moe.attention)
        self.mlp = Qwen2MLP(config)
        self.gen_mlp = Qwen2MLP(config) if in_range and moe.ffn else None
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, route, is_gen, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, route, is_gen, cache)
        h = self.post_attention_layernorm(x)
        if self.gen_mlp is None:
            return x + self.mlp(h)
        return x + _route(h, route, is_gen, self.mlp, self.gen_mlp)


class MammothDecoder(nn.Module):
    """Embeddings (text + gen), decoder layers and final norm; parameter names follow Qwen2's `model.*`."""

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        self.gen_start = config.gen_vocab_start_index
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.gen_embed_tokens = nn.Embedding(config.gen_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MammothDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Qwen2RotaryEmbedding reads rope settings from a v5-style `rope_parameters` dict.
        rope_view = SimpleNamespace(
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            max_position_embeddings=config.max_position_embeddings,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
        )
        self.rotary_emb = Qwen2RotaryEmbedding(rope_view)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        is_gen = input_ids >= self.gen_start
        text_ids = input_ids.clamp(0, self.embed_tokens.num_embeddings - 1)
        gen_ids = (input_ids - self.gen_start).clamp(0, self.gen_embed_tokens.num_embeddings - 1)
        x = torch.where(is_gen[..., None], self.gen_embed_tokens(gen_ids), self.embed_tokens(text_ids))
        # One host sync per forward decides the routing path for every layer.
        n_gen = int(is_gen.sum())
        route = "text" if n_gen == 0 else "gen" if n_gen == is_gen.numel() else "mixed"
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, route, is_gen, cache)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.norm(x)


class MammothARModel(PreTrainedModel):
    """The whole AR: decoder + text head + generation head."""

    config_class = MammothARConfig
    config: MammothARConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["MammothDecoderLayer"]

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__(config)
        self.model = MammothDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gen_head = nn.Linear(config.hidden_size, config.gen_vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        num_logits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (float32 logits over text+gen vocab, final-norm hidden states).

        `num_logits` keeps only the last n positions' logits (prefill needs just the last one).
        """
        if position_ids is None:
            past = 0 if cache is None else cache.length
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        hidden = self.model(input_ids, position_ids, cache)
        h = hidden if num_logits is None else hidden[:, -num_logits:]
        logits = torch.cat([self.lm_head(h), self.gen_head(h)], dim=-1).float()
        return logits, hidden
