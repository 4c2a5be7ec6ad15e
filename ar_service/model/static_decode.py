"""The AR's fast decode step: fixed slots, a preallocated K/V cache, and on CUDA one captured graph per length bucket.

Why: an eager decode token of a 7B-class decoder launches ~1,000 small kernels, and their launch cost, not the
weights' memory traffic, sets the pace (66.9 ms per token measured on an H200, against a ~3 ms bandwidth bound).
Here every shape is fixed: ``slots`` rows (a stream keeps its slot from prefill to its last token; free slots
compute padding), K/V written in place at each row's position, attention over the first ``bucket`` cached
positions with a per-row mask. A step is then a fixed sequence of kernels, captured once per bucket in a
``torch.cuda.CUDAGraph`` and replayed for a few microseconds of CPU time. Optionally the per-layer elementwise
work (RMSNorm, RoPE, SwiGLU, residuals) is fused by ``torch.compile`` around cuBLAS's matmuls.

Every decode token of a T2I request is a generation-vocabulary id, so the step takes the generation path of
every layer (expert weights where the layer has them) and computes only ``gen_head``'s logits: the sampler's
allowed ranges never leave the generation vocabulary, and the text head (545 M parameters in Preview) would
be a sixth of the bytes read per token for nothing. The next token is drawn inside the graph too
(``sampling.sample_rows``), so a step costs one small upload of ids, positions and draw inputs and one
download of the drawn ids.

The numbers match ``MammothModa2AR.decode`` up to floating-point reordering (tests compare them). A step runs
only as many rows as the highest slot in use needs (1, 2, 4, 8, ...): a lone stream does not pay for seven
padding rows. Matmul kernels may round differently for another row count, so in this default mode an image
can change (slightly) with its batch-mates. With ``full_length`` every step runs all slots and attends over the
whole cache: no shape depends on the batch-mates and a stream's result is batch-invariant to the bit.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.sampling import RowSampling, SamplingParams, sample_rows

log = logging.getLogger(__name__)

#: What free rows draw (a forced single id: the cheapest draw there is).
_PADDING_DRAW = SamplingParams(1.0, 1, 1.0)

#: Positions per length bucket: a step attends over the smallest multiple of this that covers every row.
BUCKET = 256


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _pre_attention(x, norm_w, eps: float, qw, qb, kw, kb, vw, vb, cos, sin, heads: int, kv_heads: int):
    """RMSNorm, q/k/v projections, RoPE: [P, H] -> q [P, heads, D], k and v [P, kv_heads, D]."""
    p = x.shape[0]
    h = _rms_norm(x, norm_w, eps)
    q = F.linear(h, qw, qb).view(p, heads, -1)
    k = F.linear(h, kw, kb).view(p, kv_heads, -1)
    v = F.linear(h, vw, vb).view(p, kv_heads, -1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _post_attention(x, attn, ow, norm_w, eps: float, gw, uw, dw):
    """Output projection and residual, then RMSNorm + SwiGLU MLP and residual."""
    x = x + F.linear(attn, ow)
    h = _rms_norm(x, norm_w, eps)
    return x + F.linear(F.silu(F.linear(h, gw)) * F.linear(h, uw), dw)


class StaticDecoder:
    """Batched decode over ``slots`` fixed rows with an in-place K/V cache of ``max_positions`` per slot."""

    def __init__(
        self,
        model: MammothModa2AR,
        slots: int,
        max_positions: int,
        cuda_graphs: bool = True,
        compile: bool = False,
        full_length: bool = False,
    ) -> None:
        config = model.config
        if slots < 1 or max_positions < 2:
            raise ValueError("StaticDecoder needs at least one slot and two positions")
        self.model, self.config = model, config
        self.slots, self.max_positions, self.full_length = slots, max_positions, full_length
        device, dtype = model.device, model.dtype
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        text = model.model.language_model
        self.text = text
        layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        shape = (layers, slots, kv_heads, max_positions, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.ids = torch.full((slots,), config.gen_vocab_start_index, dtype=torch.long, device=device)
        # Free rows compute at the last position, which no real stream reaches (max_positions is one past the
        # longest prompt + grid), so their K/V writes never land on a real stream's positions.
        self.positions = torch.full((slots,), max_positions - 1, dtype=torch.long, device=device)
        self._rows = torch.arange(slots, device=device)
        self.draws = RowSampling.empty(slots, device)
        self._free = list(range(slots))
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self._layer_weights = [self._weights(layer) for layer in text.layers]
        self._pre, self._post = _pre_attention, _post_attention
        if compile:
            self._pre = torch.compile(_pre_attention, dynamic=False, fullgraph=True)
            self._post = torch.compile(_post_attention, dynamic=False, fullgraph=True)

    @staticmethod
    def _weights(layer) -> tuple:
        """The generation path's weights of one layer: expert copies where the layer has them."""
        attn = layer.self_attn
        a = "gen_" if attn.experts else ""
        proj = [getattr(attn, f"{a}{name}_proj") for name in ("q", "k", "v", "o")]
        mlp = layer.gen_mlp if layer.gen_mlp is not None else layer.mlp
        return (
            layer.input_layernorm.weight, layer.input_layernorm.eps,
            proj[0].weight, proj[0].bias, proj[1].weight, proj[1].bias, proj[2].weight, proj[2].bias,
            proj[3].weight,
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
        )

    # -- slots ------------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def admit(self, cache: KVCache) -> int:
        """Takes a free slot and copies a prefilled stream's K/V into it; returns the slot."""
        if not self._free:
            raise RuntimeError("no free decode slot")
        if cache.length >= self.max_positions - 1:
            raise ValueError(f"prompt of {cache.length} positions does not fit {self.max_positions - 1}")
        slot = self._free.pop(0)
        n = cache.length
        for layer, (k, v) in enumerate(zip(cache._k, cache._v)):
            self.k[layer, slot, :, :n] = k[0, :, :n]
            self.v[layer, slot, :, :n] = v[0, :, :n]
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)
        self._free.sort()

    # -- the step ---------------------------------------------------------------------------------

    def step(
        self,
        slots: list[int],
        ids: list[int],
        positions: list[int],
        draws: list[tuple[tuple[int, int], SamplingParams, int, int]],
    ) -> tuple[list[int], torch.Tensor]:
        """One token for each listed slot, fed ``ids`` at ``positions``; ``draws`` are ``sample_rows``' inputs
        (allowed range, params, seed, step) of the token each draws. Returns (drawn ids, condition hidden states
        [B, H]) in the order given."""
        if not (len(slots) == len(ids) == len(positions) == len(draws)) or not slots:
            raise ValueError("step needs one id, one position and one draw per slot")
        start = self.config.gen_vocab_start_index
        if min(ids) < start:
            raise ValueError("the fast decode step takes generation-vocabulary ids only")
        if max(positions) >= self.max_positions - 1:
            raise ValueError(f"position {max(positions)} is beyond the decode cache ({self.max_positions - 1})")
        rows = self.slots if self.full_length else min(self.slots, 1 << max(slots).bit_length())
        id_rows = [start] * rows
        pos_rows = [self.max_positions - 1] * rows
        draw_rows = [((start, start), _PADDING_DRAW, 0, 0)] * rows
        for slot, token, position, draw in zip(slots, ids, positions, draws):
            id_rows[slot], pos_rows[slot], draw_rows[slot] = token, position, draw
        self.ids[:rows].copy_(torch.tensor(id_rows, dtype=torch.long))
        self.positions[:rows].copy_(torch.tensor(pos_rows, dtype=torch.long))
        self.draws.fill(draw_rows)
        bucket = self.max_positions if self.full_length else min(
            self.max_positions, BUCKET * math.ceil((max(positions) + 1) / BUCKET)
        )
        if self.cuda_graphs:
            drawn, hidden = self._replay(bucket, rows)
        else:
            drawn, hidden = self._forward(bucket, rows)
        index = torch.tensor(slots, device=self.device)
        return drawn.index_select(0, index).tolist(), hidden.index_select(0, index)

    def _replay(self, bucket: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._graphs.get((bucket, rows))
        if entry is None:
            entry = self._capture(bucket, rows)
        graph, drawn, hidden = entry
        graph.replay()
        return drawn, hidden

    def _capture(self, bucket: int, rows: int):
        # Warm up on a side stream (compilation, cuBLAS workspaces), then capture. The inputs are saved and put
        # back: the warm-up runs write K/V at the rows' current positions, which the real step rewrites.
        saved = [t.clone() for t in (self.ids, self.positions)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            drawn, hidden = self._forward(bucket, rows)
        self.ids.copy_(saved[0])
        self.positions.copy_(saved[1])
        self._graphs[(bucket, rows)] = (graph, drawn, hidden)
        log.info("captured the decode step for %d rows x %d positions (%d graphs)", rows, bucket, len(self._graphs))
        return self._graphs[(bucket, rows)]

    def _forward(self, bucket: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over the first ``p`` rows: (drawn ids [p], condition hidden states [p, H])."""
        config, text = self.config, self.text
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        group = heads // kv_heads
        ids, positions, rows = self.ids[:p], self.positions[:p], self._rows[:p]
        x = text.gen_embed_tokens(ids - config.gen_vocab_start_index)
        freqs = positions[:, None].float() * text.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [P, 1, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        visible = torch.arange(bucket, device=self.device)[None] <= positions[:, None]  # [P, bucket]
        bias = torch.zeros(p, 1, 1, bucket, device=self.device).masked_fill(~visible[:, None, None], float("-inf"))
        scale = 1.0 / math.sqrt(head_dim)
        keep = config.condition_layers
        n = len(text.layers)
        wanted = None if keep is None else {i % (n + 1) for i in keep}
        kept: dict[int, torch.Tensor] = {}
        for i, weights in enumerate(self._layer_weights):
            if wanted is not None and i in wanted:
                kept[i] = x
            (n1, e1, qw, qb, kw, kb, vw, vb, ow, n2, e2, gw, uw, dw) = weights
            q, k, v = self._pre(x, n1, e1, qw, qb, kw, kb, vw, vb, cos, sin, heads, kv_heads)
            self.k[i][rows, :, positions] = k
            self.v[i][rows, :, positions] = v
            keys = self.k[i, :p, :, :bucket]  # [P, kv, bucket, D]
            values = self.v[i, :p, :, :bucket]
            scores = torch.matmul(q.view(p, kv_heads, group, head_dim), keys.transpose(-1, -2)).float() * scale
            probs = (scores + bias).softmax(dim=-1).to(x.dtype)
            attn = torch.matmul(probs, values).reshape(p, heads * head_dim)
            x = self._post(x, attn, ow, n2, e2, gw, uw, dw)
        final = _rms_norm(x, text.norm.weight, text.norm.eps)
        if keep is None:
            hidden = final
        else:
            kept[n] = final
            hidden = torch.stack([kept[i % (n + 1)] for i in keep], dim=0).mean(dim=0)
        logits = self.model.gen_head(final)
        draws = RowSampling(*(getattr(self.draws, f)[:p] for f in RowSampling.__dataclass_fields__))
        return sample_rows(logits, config.gen_vocab_start_index, draws), hidden
