"""MammothModa2's AR: a Qwen2.5 (Preview) or Qwen3-VL (Dev) text decoder whose generation-vocabulary positions use
expert weights.

Preview facts followed (bytedance/mammothmoda ``mammothmoda2/model/mammothmoda2_qwen2_5_vl/modeling_mammothmoda2_qwen2_5_vl.py``,
``Mammothmoda2Qwen2_5_VLForConditionalGeneration`` / ``Qwen2_5_VLModel`` / ``Qwen2_5_VLTextModel``):

- Module tree (so that the checkpoint's tensors under ``llm_model.`` load by name): ``model.language_model``
  holds ``embed_tokens`` (text vocab rows), ``gen_embed_tokens`` (gen vocab rows), ``layers.N`` and ``norm``;
  ``lm_head`` (text vocab) and ``gen_head`` (gen vocab) sit beside ``model``; the vision tower
  ``model.visual`` is not built here (text-to-image never runs it; the loader skips its keys explicitly).
- Layer N: ``input_layernorm``, ``self_attn.{q,k,v}_proj`` (bias), ``self_attn.o_proj`` (no bias),
  ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (no bias); experts per ``moe_type`` are
  ``gen_mlp.*`` and ``self_attn.gen_{q,k,v,o}_proj`` (same shapes and biases as their text twins).
- Hard routing: ``gen_token_mask = input_ids >= gen_vocab_start_index``; masked positions take the gen
  embedding and, on expert layers, the gen weights; others the text weights (upstream ``moe_forward``).
- Logits: ``cat([lm_head(h), gen_head(h)], -1)`` over the final-normed hidden state.
- RoPE: Qwen2.5-VL's multimodal RoPE with three identical position streams for pure text (upstream
  ``get_rope_index`` without images), which equals ordinary 1-D RoPE with ``rope_theta``; cos/sin are
  computed in float32 and cast to the activation dtype, as upstream's rotary embedding does.
- RMSNorm: float32 variance, ``weight * normed.to(input_dtype)`` (upstream ``Qwen2RMSNorm``).

Dev (``member == "dev"``; bytedance/mammothmoda main, ``mamoda2/mammothmoda2/model/mammothmoda2_qwen3_vl/
modeling_mammothmoda2_qwen3_vl.py`` "QM", a copy of transformers 4.57.1's Qwen3-VL plus the Mammoth parts), same module
tree and routing, with these differences:

- q/k/v/o projections take ``bias=attention_bias`` (default False) (QM:480-491); no attention experts (the released
  layer checks ``moe_type`` for "ffn" only, QM:567).
- ``self_attn.q_norm`` / ``k_norm``: RMSNorm(head_dim, rms_norm_eps) on each head after the view to heads and before
  RoPE (QM:492-494, 511-516); q_proj's width is heads * ``head_dim`` (explicit in the config, may differ from hidden).
- RoPE: Qwen3-VL's interleaved MRoPE (QM:308-344) with ``rope_theta`` (5e6) over ``head_dim``; with the three axes'
  positions equal (text and generation tokens: no understanding images in text-to-image) it is 1-D RoPE with the
  same inv_freq, which is what runs here.
- Hidden-states tuple (``gen_condition_layers``): (embeddings, output of layer 0, ..., output of layer N-1), the last
  entry not normed (``ARConfig.final_hidden_normed`` False).
- Token ids: the logit index is the id; gen_head column c is id ``vocab_size + c`` (``ARConfig.gen_logit_start``),
  while routing and the gen embedding use ``id >= gen_vocab_start_index`` and ``id - gen_vocab_start_index``
  (QM:917-927, 1522-1527); the two starts may differ (``ARConfig`` docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ar_service.model.configuration import ARConfig


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
        if buf_k is None or buf_v is None or buf_k.shape[2] < end:  # k and v are always set together
            size = max(end, self.capacity, 2 * (0 if buf_k is None else buf_k.shape[2]))
            new_k = k.new_empty(k.shape[0], k.shape[1], size, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], size, v.shape[3])
            if buf_k is not None and buf_v is not None:
                new_k[:, :, :start] = buf_k[:, :, :start]
                new_v[:, :, :start] = buf_v[:, :, :start]
            self._k[layer], self._v[layer] = new_k, new_v
            buf_k, buf_v = new_k, new_v
        buf_k[:, :, start:end] = k
        buf_v[:, :, start:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def write(self, layer: int, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one position's k/v [1, kv_heads, 1, D] at ``index`` (a decode lane writes where its token sits in
        the sequence, which may lie past ``length``: a draft the stream has not accepted yet)."""
        end = index + 1
        while len(self._k) <= layer:
            self._k.append(None)
            self._v.append(None)
        buf_k, buf_v = self._k[layer], self._v[layer]
        if buf_k is None or buf_v is None or buf_k.shape[2] < end:  # allocate, or grow keeping what is there
            size = max(end, self.capacity, 2 * (0 if buf_k is None else buf_k.shape[2]))
            new_k = k.new_zeros(k.shape[0], k.shape[1], size, k.shape[3])
            new_v = v.new_zeros(v.shape[0], v.shape[1], size, v.shape[3])
            if buf_k is not None and buf_v is not None:
                new_k[:, :, : buf_k.shape[2]] = buf_k
                new_v[:, :, : buf_v.shape[2]] = buf_v
            self._k[layer], self._v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, index:end] = k
        buf_v[:, :, index:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``end`` positions' k/v of ``layer``."""
        buf_k, buf_v = self._k[layer], self._v[layer]
        assert buf_k is not None and buf_v is not None, "a layer is viewed after it was written"
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def advance(self, tokens: int) -> None:
        """Called once per forward, after every layer appended its `tokens` new positions."""
        self.length += tokens

    def copy(self, capacity: int = 0) -> KVCache:
        """An independent cache holding this one's positions, its buffers sized for ``capacity`` positions
        (the shared system-prompt prefix is computed once and copied into every decode stream)."""
        out = KVCache(capacity=max(capacity, self.length))
        size = out.capacity
        for buf_k, buf_v in zip(self._k, self._v, strict=True):
            if buf_k is None or buf_v is None:  # a layer not reached yet (k and v are always set together)
                out._k.append(None)
                out._v.append(None)
                continue
            new_k = buf_k.new_empty(buf_k.shape[0], buf_k.shape[1], size, buf_k.shape[3])
            new_v = buf_v.new_empty(buf_v.shape[0], buf_v.shape[1], size, buf_v.shape[3])
            new_k[:, :, : self.length] = buf_k[:, :, : self.length]
            new_v[:, :, : self.length] = buf_v[:, :, : self.length]
            out._k.append(new_k)
            out._v.append(new_v)
        out.length = self.length
        return out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """Qwen2 SwiGLU MLP (no biases)."""

    def __init__(self, config: ARConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _route(x: torch.Tensor, route: str, is_gen: torch.Tensor, text_fn: Callable, gen_fn: Callable | None) -> torch.Tensor:
    """Hard routing per position; the all-text / all-gen fast paths avoid gathers during decode."""
    if gen_fn is None or route == "text":
        return text_fn(x)
    if route == "gen":
        return gen_fn(x)
    text_out = text_fn(x[~is_gen])
    out = x.new_empty(*x.shape[:-1], text_out.shape[-1])
    out[~is_gen] = text_out
    out[is_gen] = gen_fn(x[is_gen])
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """GQA attention with optional generation-expert projections: Qwen2 (Preview: q/k/v biased, o unbiased) or Qwen3
    (Dev: every projection biased only with ``attention_bias``, per-head ``q_norm`` / ``k_norm`` before RoPE)."""

    def __init__(self, config: ARConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.experts = config.moe.enabled("attention", layer_idx)
        prefixes = ("", "gen_") if self.experts else ("",)
        for p in prefixes:
            setattr(self, f"{p}q_proj", nn.Linear(h, q, bias=config.attention_bias))
            setattr(self, f"{p}k_proj", nn.Linear(h, kv, bias=config.attention_bias))
            setattr(self, f"{p}v_proj", nn.Linear(h, kv, bias=config.attention_bias))
            setattr(self, f"{p}o_proj", nn.Linear(q, h, bias=config.o_proj_bias))
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # the modules exist only then (no q_norm / k_norm keys in a Preview state dict)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _proj(self, name: str, x: torch.Tensor, route: str, is_gen: torch.Tensor) -> torch.Tensor:
        gen = getattr(self, f"gen_{name}") if self.experts else None
        return _route(x, route, is_gen, getattr(self, name), gen)

    def _qkv(self, x, cos, sin, route, is_gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, heads, T, D] with RoPE applied; Dev's q/k norms act on [B, T, heads, D] before it (QM:511-516)."""
        b, t, _ = x.shape
        q = self._proj("q_proj", x, route, is_gen).view(b, t, self.heads, self.head_dim)
        k = self._proj("k_proj", x, route, is_gen).view(b, t, self.kv_heads, self.head_dim)
        v = self._proj("v_proj", x, route, is_gen).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x, cos, sin, route, is_gen, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin, route, is_gen)
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

    def decode(self, x, cos, sin, route, is_gen, caches: list[KVCache], indexes: list[int] | None = None) -> torch.Tensor:
        """One new token per row of ``x`` [P, 1, H]; row b < len(caches) belongs to caches[b], the rest is padding.

        Projections run over all P rows at once; attention runs per stream over its own cache (padding rows
        attend to nothing and stay zero), so a row's result does not depend on the other rows. With ``indexes``
        (decode lanes: several rows may share a cache), row b writes its k/v at ``indexes[b]`` of its cache and
        attends to the positions up to it; every row writes before any attends, so a lane sees the lanes before it
        in the same forward.
        """
        p = x.shape[0]
        q, k, v = self._qkv(x, cos, sin, route, is_gen)
        out = q.new_zeros(p, self.heads, 1, self.head_dim)
        if indexes is not None:
            for b, (cache, index) in enumerate(zip(caches, indexes, strict=True)):
                cache.write(self.layer_idx, index, k[b : b + 1], v[b : b + 1])
            for b, (cache, index) in enumerate(zip(caches, indexes, strict=True)):
                kb, vb = cache.view(self.layer_idx, index + 1)
                out[b : b + 1] = F.scaled_dot_product_attention(q[b : b + 1], kb, vb, enable_gqa=True)
        for b, cache in enumerate(caches if indexes is None else ()):
            kb, vb = cache.append(self.layer_idx, k[b : b + 1], v[b : b + 1])
            out[b : b + 1] = F.scaled_dot_product_attention(q[b : b + 1], kb, vb, enable_gqa=True)
        out = out.transpose(1, 2).reshape(p, 1, self.heads * self.head_dim)
        return self._proj("o_proj", out, route, is_gen)


class DecoderLayer(nn.Module):
    """Pre-norm Qwen2 block; ``gen_mlp`` exists only on layers the moe_type range selects."""

    def __init__(self, config: ARConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.gen_mlp = MLP(config) if config.moe.enabled("ffn", layer_idx) else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, route, is_gen, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, route, is_gen, cache)
        return x + _route(self.post_attention_layernorm(x), route, is_gen, self.mlp, self.gen_mlp)

    def decode(self, x, cos, sin, route, is_gen, caches: list[KVCache], indexes: list[int] | None = None) -> torch.Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, route, is_gen, caches, indexes)
        return x + _route(self.post_attention_layernorm(x), route, is_gen, self.mlp, self.gen_mlp)


class TextModel(nn.Module):
    """``llm_model.model.language_model``: embeddings (text + gen), decoder layers, final norm."""

    def __init__(self, config: ARConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.gen_embed_tokens = nn.Embedding(config.gen_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        """Default-RoPE inv_freq over head_dim with rope_theta (transformers' default rope init, Preview and Dev)."""
        d = self.config.head_dim
        return 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def reset_rope(self, device: torch.device) -> None:
        """Recompute the (non-persistent) RoPE buffer, e.g. after building on the meta device."""
        self.inv_freq = self._inv_freq().to(device)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache | None, keep: tuple[int, ...] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (final-normed hidden states, condition states).

        Condition states are the final-normed states, or, when ``keep`` lists indices into the Hugging Face
        ``output_hidden_states`` tuple (N + 1 entries: entry i < N = input of layer i, i.e. the embeddings for i = 0
        and layer i-1's output otherwise; entry N = the final norm (Preview) or layer N-1's un-normed output (Dev),
        ``ARConfig.final_hidden_normed``), their mean (bytedance/mammothmoda ``mamoda2/mammothmoda2/utils/t2i_utils.py``
        ``encode_full_prompts``: ``torch.stack([hidden_states[i] for i in gen_condition_layers]).mean(0)``).
        """
        x, route, is_gen, cos, sin = self._inputs(input_ids, position_ids)
        n = len(self.layers)
        wanted = None if keep is None else {i % (n + 1) for i in keep}
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if wanted is not None and i in wanted:
                kept[i] = x
            x = layer(x, cos, sin, route, is_gen, cache)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self._outputs(x, keep, kept)

    def _inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        config = self.config
        is_gen = input_ids >= config.gen_vocab_start_index  # routing and embedding by id (QM:917-927)
        text_ids = input_ids.clamp(0, self.embed_tokens.num_embeddings - 1)
        gen_ids = config.gen_embedding_row(input_ids).clamp(0, self.gen_embed_tokens.num_embeddings - 1)
        x = torch.where(is_gen[..., None], self.gen_embed_tokens(gen_ids), self.embed_tokens(text_ids))
        # One host sync per forward decides the routing path for every layer.
        if config.vocab_size < config.gen_vocab_start_index:
            # Ids in [vocab_size, gen_vocab_start_index) route as text but have no embed_tokens row: the released
            # embedding lookup fails on them, and so does this one (never silently clamped).
            hole = (~is_gen) & (input_ids >= config.vocab_size)
            n_gen, n_hole = torch.stack([is_gen.sum(), hole.sum()]).tolist()
            if n_hole:
                raise ValueError(f"token ids in [{config.vocab_size}, {config.gen_vocab_start_index}) have no embedding "
                                 f"row (text vocab_size {config.vocab_size}, generation ids from "
                                 f"{config.gen_vocab_start_index}): {sorted(set(input_ids[hole].tolist()))[:8]}")
        else:
            n_gen = int(is_gen.sum())
        route = "text" if n_gen == 0 else "gen" if n_gen == is_gen.numel() else "mixed"
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x, route, is_gen, cos, sin

    def decode(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: list[KVCache], keep: tuple[int, ...] | None,
        indexes: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token for each of ``len(caches)`` streams, ``input_ids``/``position_ids`` [P, 1] with P >= that
        many rows (the rest padding): same outputs as ``forward`` but each stream over its own cache. With
        ``indexes`` (see ``Attention.decode``) no cache advances: the caller says what its lanes' caches hold."""
        x, route, is_gen, cos, sin = self._inputs(input_ids, position_ids)
        n = len(self.layers)
        wanted = None if keep is None else {i % (n + 1) for i in keep}
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):  # nn.ModuleList yields plain Modules
            if wanted is not None and i in wanted:
                kept[i] = x
            x = layer.decode(x, cos, sin, route, is_gen, caches, indexes)
        for cache in caches if indexes is None else ():
            cache.advance(1)
        return self._outputs(x, keep, kept)

    def _outputs(self, x: torch.Tensor, keep, kept: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.layers)
        final = self.norm(x)
        if keep is None:
            return final, final
        kept[n] = final if self.config.final_hidden_normed else x  # the tuple's last entry (ARConfig.final_hidden_normed)
        return final, torch.stack([kept[i % (n + 1)] for i in keep], dim=0).mean(dim=0)


class VLModel(nn.Module):
    """``llm_model.model``: only its ``language_model`` is built (the ``visual`` tower is not needed for T2I)."""

    def __init__(self, config: ARConfig) -> None:
        super().__init__()
        self.language_model = TextModel(config)


class MammothModa2AR(nn.Module):
    """``llm_model``: the whole AR (decoder + text head + generation head); state-dict keys = checkpoint keys
    with the ``llm_model.`` prefix stripped (vision tower excepted)."""

    def __init__(self, config: ARConfig) -> None:
        super().__init__()
        self.config = config
        self.model = VLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gen_head = nn.Linear(config.hidden_size, config.gen_vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def logits(self, hidden: torch.Tensor, t2i: bool = True) -> torch.Tensor:
        """Float32 logits over [text | gen] vocab; non-T2I requests never see the generation vocabulary."""
        logits = torch.cat([self.lm_head(hidden), self.gen_head(hidden)], dim=-1).float()
        return mask_generation_vocab(logits, self.config.gen_logit_start, t2i)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        num_logits: int | None = None,
        t2i: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (float32 logits over text+gen vocab, condition hidden states [B, T, H]).

        The condition states are the final-normed hidden states (Preview), or the configured layer
        average (``gen_condition_layers``, Dev). ``num_logits`` keeps only the last n positions' logits.
        """
        if position_ids is None:
            past = 0 if cache is None else cache.length
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(input_ids.shape[0], -1)
        final, condition = self.model.language_model(input_ids, position_ids, cache, self.config.condition_layers)
        h = final if num_logits is None else final[:, -num_logits:]
        return self.logits(h, t2i=t2i), condition

    def decode(
        self, input_ids: list[int], positions: list[int], caches: list[KVCache], pad_to: int = 0,
        indexes: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched decode token for B streams, each with its own cache: returns (float32 logits over gen_head's
        columns [B, gen_vocab_size], column c being token id ``config.gen_logit_start + c`` (``config.gen_column_id``;
        not ``gen_vocab_start_index + c``: the two differ when vocab_size != gen_vocab_start_index), and condition
        hidden states [B, H]). Decode tokens are T2I grid tokens, whose allowed ids all lie in the generation
        vocabulary (``config.gen_id_range``), so the text head is not computed (the same numbers as ``logits()``'s
        generation columns).

        The batch is padded to ``pad_to`` rows (padding rows: the first id of ``gen_id_range`` at position 0, no cache),
        so that every matmul has the same shape however many streams are real: CPU BLAS may pick another
        kernel, and so round differently, for another row count, and a stream's result must not depend on
        what it is batched with.

        ``indexes``: decode lanes, several rows of one stream in one forward (``Attention.decode``); row b then
        writes at ``indexes[b]`` of ``caches[b]`` (RoPE still at ``positions[b]``) and no cache advances.
        """
        b = len(caches)
        if not b or len(input_ids) != b or len(positions) != b or (indexes is not None and len(indexes) != b):
            raise ValueError("decode needs one id, one position and one cache per stream")
        rows = max(b, pad_to)
        pad = rows - b
        device = self.device
        ids = torch.tensor(list(input_ids) + [self.config.gen_id_range.start] * pad, dtype=torch.long, device=device)
        pos = torch.tensor(list(positions) + [0] * pad, dtype=torch.long, device=device)
        final, condition = self.model.language_model.decode(
            ids[:, None], pos[:, None], caches, self.config.condition_layers, indexes
        )
        return self.gen_head(final[:b, 0]).float(), condition[:b, 0]


def mask_generation_vocab(logits: torch.Tensor, gen_logit_start: int, t2i: bool) -> torch.Tensor:
    """Non-T2I requests may not sample generation-vocabulary ids: set gen_head's columns, from ``gen_logit_start``
    (``ARConfig.gen_logit_start``, the text vocab_size), to -inf (in place).

    vllm-omni ``vllm_omni/model_executor/models/mammoth_moda2/mammoth_moda2_ar.py``
    ``_apply_t2i_token_constraints``: ``logits[i, base_vocab_size:] = -inf`` for every non-"t2i" task.
    """
    if not t2i:
        logits[..., gen_logit_start:] = float("-inf")
    return logits


def _layer_shapes(config: ARConfig) -> tuple[int, int]:
    """Parameters of one layer's attention projections (q, k, v, o with the member's biases; expert copies have the
    same) and of one MLP (gate, up, down)."""
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    bias = config.attention_bias
    attn = (h * q + q * bias) + 2 * (h * kv + kv * bias) + (q * h + h * config.o_proj_bias)
    return attn, 3 * h * f


def _layer_norms(config: ARConfig) -> int:
    """Norm weights of one layer: input and post-attention RMSNorms, and Dev's per-head q/k norms (not duplicated for
    experts)."""
    return 2 * config.hidden_size + (2 * config.head_dim if config.qk_norm else 0)


def count_parameters(config: ARConfig) -> dict[str, int]:
    """Parameter counts of the AR the config describes, computed analytically (no allocation)."""
    h, n = config.hidden_size, config.num_hidden_layers
    attn, mlp = _layer_shapes(config)
    moe = config.moe
    ffn_experts = len(moe.layers(n, "ffn"))
    attn_experts = len(moe.layers(n, "attention"))
    dense = n * (attn + mlp + _layer_norms(config)) + h + 2 * config.vocab_size * h
    experts = ffn_experts * mlp + attn_experts * attn
    gen_vocab = 2 * config.gen_vocab_size * h
    return {"dense": dense, "experts": experts, "gen_vocab": gen_vocab, "total": dense + experts + gen_vocab}


def count_decode_parameters(config: ARConfig) -> int:
    """Parameters one text-to-image decode token reads (what ``static_decode`` runs): on each layer the expert copy
    of the attention projections and of the MLP where the layer has one, the text copy otherwise (same shapes),
    both RMSNorms and Dev's q/k norms; the final norm; ``gen_head`` only (the sampler reads generation logits alone).
    The one embedding row a token looks up is left out."""
    h = config.hidden_size
    attn, mlp = _layer_shapes(config)
    return config.num_hidden_layers * (attn + mlp + _layer_norms(config)) + h + config.gen_vocab_size * h
