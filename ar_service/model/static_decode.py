"""The AR's fast decode step: fixed slots, a preallocated K/V cache, and on CUDA one captured graph per shape.

Why: an eager decode token of a 7B-class decoder launches ~1,000 small kernels, and their launch cost, not the
weights' memory traffic, sets the pace (66.9 ms per token measured on an H200, against a ~3 ms bandwidth bound).
Here every shape is fixed: ``slots`` rows (a stream keeps its slot from prefill to its last token; free slots
compute padding), K/V written in place at each row's position. A step is then a fixed sequence of kernels,
captured once in a ``torch.cuda.CUDAGraph`` and replayed for a few microseconds of CPU time.

Two kernel sets run the layers. "triton" (``decode_kernels``): nine launches per layer, the small work folded
into the weight reads, attention over each row's own length read on the device, so one graph per row count.
"torch": cuBLAS matmuls, optionally with the elementwise work fused by ``torch.compile``, attention over the
first ``bucket`` cached positions with a per-row mask, so one graph per row count and length bucket.

Every decode token of a T2I request is a generation-vocabulary id, so the step takes the generation path of
every layer (expert weights where the layer has them) and computes only ``gen_head``'s logits: the sampler's
allowed ranges never leave the generation vocabulary, and the text head (545 M parameters in Preview) would
be a sixth of the bytes read per token for nothing. The next token is drawn inside the graph too
(``sampling.sample_rows``), so a step costs one small upload of ids, positions and draw inputs and one
download of the drawn ids. As in the eager model, ``gen_head``'s column j is drawn as id ``gen_logit_start + j``
and a fed id is embedded as ``gen_embed_tokens[id - gen_vocab_start_index]``: the two offsets differ where the
text vocabulary is smaller than the fixed generation start (Dev with vocab_size 151936: 128 ids), a skew the
released code has and this step keeps.

Both members' layers run on either kernel set: Preview's (q/k/v biases) and Dev's (no biases; a per-head q/k
RMSNorm before RoPE, which the triton kernels fold into the launch that rotates and writes K/V, so a Dev layer
is nine launches too; a head_dim of its own, so q is heads * head_dim wide, not hidden). The condition hidden
state is the final norm, or the mean of ``condition_layers``' entries of the hidden-states tuple, whose entry N
is the final norm (Preview) or the last layer's output before it (Dev, ``final_hidden_normed`` False).

The numbers match ``MammothModa2AR.decode`` up to floating-point reordering (tests compare them). A step runs
only as many rows as the highest slot in use needs (1, 2, 4, 8, ...): a lone stream does not pay for seven
padding rows. With the torch kernels, matmuls may round differently for another row count, so an image can
change (slightly) with its batch-mates; the triton kernels compute each row on its own. With ``full_length``
every step runs all slots (and the torch kernels attend over the whole cache): no shape depends on the
batch-mates and a stream's result is batch-invariant to the bit.
"""

from __future__ import annotations

import gc
import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ar_service.model import decode_kernels
from ar_service.model.modeling import KVCache, MammothModa2AR
from ar_service.sampling import RowSampling, SamplingParams, draw_columns, gumbel_noise, sample_rows
from servicekit.devices import DeviceTimer
from servicekit.fp8 import dequantize

log = logging.getLogger(__name__)

#: The smallest length bucket (positions a step attends over).
MIN_BUCKET = 256


def bucket_for(positions: int) -> int:
    """Attention length for ``positions`` cached positions: a quarter-octave grid (256, 320, 384, 448, 512, 640,
    ...), so a step reads at most ~25% masked positions and a 16k-position cache needs ~28 graphs per row count."""
    if positions <= MIN_BUCKET:
        return MIN_BUCKET
    quantum = max(MIN_BUCKET // 4, 1 << (positions.bit_length() - 3))
    return quantum * math.ceil(positions / quantum)


#: ``lane_attention`` settings under which the torch kernels' steps of lanes read their slots in place with
#: ``decode_kernels.attention``: once per row, or once for all of a slot's rows in the step.
DIRECT_LANE_ATTENTION = ("triton", "triton-slots")

#: The fewest rows a step of lanes has for ``lane_attention`` "triton-slots" to read each slot once for all of its
#: rows; a narrower step reads once a row. Measured on one H200 at Preview shapes (bench/results/h200/lane-attention/):
#: one layer's attention took 271 us once a row and 157 us once a slot at 256 rows (16 streams), but 77 and 86 us at
#: 64 rows and 61 and 72 us at 34 (2 streams), where the once-a-row read's many more programs win; 16 row-parallel
#: streams' steps (174 rows on average) took 12.4 ms instead of 14.3.
GROUPED_LANE_ROWS = 128

#: The rows a step of lanes may run with the torch kernels unless set (``lane_rows_for``). A pass reads every weight
#: once whatever its rows: on an H100 a torch-kernel step took 6.95 ms at 2 rows, 9.28 at 32 and 11.77 at 64
#: (bench/results/h100/verify_torch.json), while in passes of only their 8 slots, 4 row-parallel streams took about
#: 7 passes (55.5 ms) a step (bench/results/h100/saturation-lanes/NOTES.md).
DEFAULT_LANE_ROWS = 64


def lane_rows_for(setting: int, slots: int, kernels: str, full_length: bool = False) -> int:
    """The ``decode_lane_rows`` setting made concrete for a decoder of ``slots``: never fewer than the slots; 0 (auto)
    is ``DEFAULT_LANE_ROWS`` with the torch kernels and the slots with the triton ones, whose row tile follows the
    widest step (a wider tile would slow every step of a few streams), or with ``full_length``, where every step
    runs the slots' rows."""
    if setting:
        return max(setting, slots)
    return max(slots, DEFAULT_LANE_ROWS) if kernels == "torch" and not full_length else slots


def resolve_decode_kernels(setting: str, device: torch.device, slots: int, dtype: torch.dtype, fp8: bool = False) -> str:
    """The ``decode_kernels`` setting made concrete: auto is triton on a CUDA device when the triton package
    imports, the slots fit one launch and the kernels compile and run there (``decode_kernels.probe``, at the
    slots' row tile, with an FP8 weight when ``fp8``), else torch. Up to 16 slots the triton kernels serve both
    precisions; 17-64 slots only FP8 weights (bf16 there keeps cuBLAS, the one measured at those row counts;
    the torch kernels would dequantize each FP8 weight at every step). With FP8 weights on the torch kernels
    (slower than bf16, and memory for the dequantized weights) a warning says so."""
    kernels = _resolve_decode_kernels(setting, device, slots, dtype, fp8)
    if fp8 and kernels == "triton" and decode_kernels.row_tile(slots) not in decode_kernels.GEMV_TILES:
        log.warning("decode kernels: %d slots with fp8 weights take the tensor-core fp8 kernel, measured slower than "
                    "bf16 on an H200; at most %d slots (max_batch_size 1) take the faster dot-free kernel "
                    "(docs/fp8.md)", slots, decode_kernels.GEMV_TILES[-1])
    if fp8 and kernels == "torch":
        log.warning("decode kernels: torch with fp8 weights dequantizes each weight every step (slower than bf16); "
                    "the triton kernels read fp8 directly (they need CUDA, the triton package and at most %d slots)",
                    decode_kernels.MAX_ROWS)
    return kernels


def _resolve_decode_kernels(setting: str, device: torch.device, slots: int, dtype: torch.dtype, fp8: bool) -> str:
    if setting != "auto":
        return setting
    if device.type != "cuda" or not decode_kernels.available:
        return "torch"
    if slots > decode_kernels.MAX_ROWS or (slots > decode_kernels.DOT_TILES[0] and not fp8):
        log.info("decode kernels: torch (%d slots; the triton kernels take at most %d, or %d with bf16 weights)",
                 slots, decode_kernels.MAX_ROWS, decode_kernels.DOT_TILES[0])
        return "torch"
    error = decode_kernels.probe(device, dtype, fp8=fp8, tile=decode_kernels.row_tile(slots))
    if error is not None:
        log.warning("decode kernels: torch (the triton kernels failed on %s: %s)", device, error)
        return "torch"
    return "triton"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _linear(x, weight, bias=None, scale=None):
    """F.linear; with ``scale`` (an FP8 weight's per-row scales) the weight is dequantized for the product."""
    return F.linear(x, weight if scale is None else dequantize(weight, scale, x.dtype), bias)


def _pre_attention(x, norm_w, eps: float, qkv_w, qkv_b, cos, sin, heads: int, kv_heads: int, qkv_s=None,
                   qk_norm=None):
    """RMSNorm, the fused q/k/v projection (``qkv_b`` None: no bias), RoPE: [P, H] -> q [P, heads, D], k and v
    [P, kv_heads, D]. ``qk_norm`` (Dev: the q norm's and the k norm's weights as one [2 D] vector, and eps): each q
    and k head is RMS-normalised over its D values before the rotation, as the eager attention does."""
    p = x.shape[0]
    qkv = _linear(_rms_norm(x, norm_w, eps), qkv_w, qkv_b, qkv_s).view(p, heads + 2 * kv_heads, -1)
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
    if qk_norm is not None:
        weight, norm_eps = qk_norm
        d = q.shape[-1]
        q, k = _rms_norm(q, weight[:d], norm_eps), _rms_norm(k, weight[d:], norm_eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _attend(q, keys, values, positions, scale: float):
    """One query per row over its first ``bucket`` cached keys (later ones masked): q [P, heads, D], keys and
    values [P, kv_heads, bucket, D] -> [P, heads * D]. GQA by viewing q as [P, kv_heads, group, D]."""
    p, heads, d = q.shape
    kv_heads, bucket = keys.shape[1], keys.shape[2]
    visible = torch.arange(bucket, device=q.device)[None] <= positions[:, None]
    scores = torch.matmul(q.view(p, kv_heads, heads // kv_heads, d), keys.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(p, heads * d)


def _post_attention(x, attn, ow, norm_w, eps: float, gate_up_w, dw, scales=None, o_bias=None):
    """Output projection (with ``o_bias``: Dev with attention_bias) and residual, then RMSNorm + SwiGLU MLP (fused
    gate/up projection) and residual. ``scales``: the FP8 scales of (o, gate/up, down)."""
    o_s, gate_up_s, down_s = scales or (None, None, None)
    x = x + _linear(attn, ow, o_bias, o_s)
    gate, up = _linear(_rms_norm(x, norm_w, eps), gate_up_w, None, gate_up_s).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, dw, None, down_s)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, for e4m3 tensors too (concatenated as their bytes)."""
    if tensors[0].dtype != torch.float8_e4m3fn:
        return torch.cat(tensors)
    return torch.cat([t.view(torch.uint8) for t in tensors]).view(torch.float8_e4m3fn)


def _fuse(modules: list) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Concatenates the weights (and biases, and FP8 scales) of linears that read the same input, and re-points
    each module's parameters at its rows of the result: one matmul instead of several, no extra memory, eager
    paths unchanged. Returns (weight, bias or None when the linears have none (Dev's q/k/v), per-row scales or
    None)."""
    weight = _cat([m.weight.detach() for m in modules])
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused linears must all have a bias or none")
    bias = torch.cat([m.bias.detach() for m in modules]) if all(has_bias) else None
    scaled = [getattr(m, "weight_scale", None) is not None for m in modules]
    if any(scaled) and not all(scaled):
        raise ValueError("fused linears must all be FP8 or all not")
    scale = torch.cat([m.weight_scale.detach() for m in modules]) if all(scaled) else None
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[start : start + n]
        if bias is not None:
            m.bias.data = bias[start : start + n]
        if scale is not None:
            m.weight_scale.data = scale[start : start + n]
        start += n
    return weight, bias, scale


def _fuse_norms(q_norm, k_norm) -> tuple[torch.Tensor, float]:
    """Dev's per-head q and k RMSNorms as one [2 D] weight (q's D values, then k's) and their eps, each module's
    weight re-pointed at its half (as ``_fuse`` does for linears): the triton kernel reads both from one pointer."""
    if q_norm.eps != k_norm.eps or q_norm.weight.shape != k_norm.weight.shape:
        raise ValueError("the q and k norms must have one head_dim and one eps")
    weight = torch.cat([q_norm.weight.detach(), k_norm.weight.detach()])
    d = q_norm.weight.shape[0]
    q_norm.weight.data, k_norm.weight.data = weight[:d], weight[d:]
    return weight, q_norm.eps


class _LayerExtras(NamedTuple):
    """What a Dev layer has beside Preview's weights: its q/k norms (``_fuse_norms``: one [2 D] weight and eps) when
    ``config.qk_norm``, and o_proj's bias when ``config.o_proj_bias``; None where it has not."""

    qk_norm: tuple[torch.Tensor, float] | None
    o_bias: torch.Tensor | None


class _Ahead:
    """A step launched before it was asked for: its inputs, and its outputs once the device has them."""

    def __init__(self, request: tuple, drawn: torch.Tensor, hidden: torch.Tensor, host: torch.Tensor) -> None:
        self.request, self.hidden = request, hidden
        self.host = host[: drawn.shape[0]]
        self.host.copy_(drawn, non_blocking=True)
        self.ready = torch.cuda.Event() if drawn.is_cuda else None
        if self.ready is not None:
            self.ready.record()

    def result(self) -> tuple[list[int], torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host.tolist()
        return [tokens[slot] for slot in self.request[0]], self.hidden


class _TorchLayers:
    """The layers on cuBLAS and torch's kernels, the bodies fused by torch.compile when ``compile``. Attention
    runs over the first ``bucket`` cached positions with a per-row mask, so the bucket is part of a step's shape.
    Row r reads slot r's cache (a view of the first rows). In a step of lanes (``gather``) it reads its own slot's:
    gathered for the step (a copy per layer), or read in place by ``decode_kernels.attention`` over the row's own
    length, so such a step has no length bucket either: with ``lane_attention`` "triton" once per row, with
    "triton-slots" once for all the step's rows of a slot (``decode_kernels.lane_groups``) in steps of
    ``GROUPED_LANE_ROWS`` rows or more."""

    bucketed = True

    def __init__(self, decoder: StaticDecoder, compile: bool, mode: str, lane_attention: str = "gather") -> None:
        self.decoder = decoder
        self.direct_lanes = lane_attention in DIRECT_LANE_ATTENTION
        self.grouped = lane_attention == "triton-slots"
        self.lanes_bucketed = not self.direct_lanes
        self.pre, self.attend, self.post = _pre_attention, _attend, _post_attention
        if compile:
            # The bodies are compiled once per row count (dynamic=False): more row counts than dynamo's default
            # recompile limit (8) would fail the capture of the widest steps and leave every later one uncompiled,
            # which happened on an H100 with steps of lanes up to 256 rows (nine row counts).
            shapes = len(set(decoder.row_counts(decoder.slots)) | set(decoder.row_counts(decoder.lane_rows)))
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes + 1)
            self.pre = torch.compile(_pre_attention, dynamic=False, fullgraph=True, mode=mode)
            self.attend = torch.compile(_attend, dynamic=True, fullgraph=True)
            self.post = torch.compile(_post_attention, dynamic=False, fullgraph=True, mode=mode)

    def start(self, cos, sin, indexes, rows, bucket: int, gather: bool) -> None:
        """Takes the step's per-row inputs (cos/sin [P, 1, D], cache indexes [P], slots [P]) before the first layer."""
        self.cos, self.sin, self.indexes, self.rows, self.bucket, self.gather = cos, sin, indexes, rows, bucket, gather
        if gather and self.direct_lanes:
            # the kernel reads plain [P] vectors, and its split results need scratch of their own
            self.indexes, self.rows = indexes.contiguous(), rows.contiguous()
            self.workspace = self.decoder.attention_workspace(rows.shape[0])
            wide = rows.shape[0] >= GROUPED_LANE_ROWS
            self.groups = self.decoder.lane_groups(self.rows) if self.grouped and wide else None

    def layer(self, i: int, weights: tuple, x: torch.Tensor) -> torch.Tensor:
        n1, e1, qkv_w, qkv_b, ow, n2, e2, gate_up_w, dw = weights
        d, config, p = self.decoder, self.decoder.config, x.shape[0]
        scales, extras = d._layer_scales[i], d._layer_extras[i]
        q, k, v = self.pre(x, n1, e1, qkv_w, qkv_b, self.cos, self.sin, config.num_attention_heads,
                           config.num_key_value_heads, None if scales is None else scales[0], extras.qk_norm)
        d.k[i][self.rows, :, self.indexes] = k
        d.v[i][self.rows, :, self.indexes] = v
        scale = 1.0 / math.sqrt(config.head_dim)
        if self.gather and self.direct_lanes:
            attn = decode_kernels.attention(q.contiguous(), d.k[i], d.v[i], self.indexes, self.rows, scale,
                                            self.workspace, d.max_positions - 1, self.groups)
        else:
            if self.gather:
                keys = d.k[i][:, :, : self.bucket].index_select(0, self.rows)
                values = d.v[i][:, :, : self.bucket].index_select(0, self.rows)
            else:
                keys, values = d.k[i, :p, :, : self.bucket], d.v[i, :p, :, : self.bucket]
            attn = self.attend(q, keys, values, self.indexes, scale)
        return self.post(x, attn, ow, n2, e2, gate_up_w, dw, None if scales is None else scales[1:], extras.o_bias)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps)

    def head(self, final: torch.Tensor) -> torch.Tensor:
        return self.decoder.model.gen_head(final)


class _TritonLayers:
    """The layers on ``decode_kernels``: attention reads each row's own length on the device, so no length
    bucket is part of a step's shape. ``fold_norms``: each residual linear emits its rows' partial sums of
    squares and the next linear applies the RMSNorm from them (seven launches per layer instead of nine).
    Every linear computes the decoder's rows (``lane_rows``, its slots unless wider) as one row tile, whatever rows
    a step runs: a row's arithmetic is the same beside any batch-mates."""

    bucketed = lanes_bucketed = False

    def __init__(self, decoder: StaticDecoder, fold_norms: bool) -> None:
        self.decoder, self.fold = decoder, fold_norms
        self.tile = decode_kernels.row_tile(decoder.lane_rows)

    def start(self, cos, sin, indexes, rows, bucket: int, gather: bool) -> None:
        """As ``_TorchLayers.start``; every row reads its own slot anyway, so ``gather`` changes nothing here."""
        # The kernels read plain [P, D] and [P] rows.
        self.cos, self.sin, self.indexes, self.rows = cos[:, 0], sin[:, 0], indexes.contiguous(), rows.contiguous()
        self.workspace = self.decoder.attention_workspace(rows.shape[0])
        self.squares: torch.Tensor | None = None  # of the layer input, when folding; the embedding is normalised by its own launch

    def layer(self, i: int, weights: tuple, x: torch.Tensor) -> torch.Tensor:
        n1, e1, qkv_w, qkv_b, ow, n2, e2, gate_up_w, dw = weights
        d, config, kernels = self.decoder, self.decoder.config, decode_kernels
        qkv_s, o_s, gate_up_s, down_s = d._layer_scales[i] or (None, None, None, None)
        qkv = kernels.linear(x, qkv_w, bias=qkv_b, norm=(n1, e1), squares=self.squares, scale=qkv_s, tile=self.tile)
        extras = d._layer_extras[i]
        q = kernels.rope_write(qkv, self.cos, self.sin, self.indexes, self.rows, d.k[i], d.v[i],
                               config.num_attention_heads, config.num_key_value_heads, extras.qk_norm)
        attn = kernels.attention(q, d.k[i], d.v[i], self.indexes, self.rows, 1.0 / math.sqrt(config.head_dim),
                                 self.workspace, d.max_positions - 1)
        x = self._residual(attn, ow, x, o_s, extras.o_bias)
        gated = kernels.linear(x, gate_up_w, norm=(n2, e2), squares=self.squares, swiglu=True, scale=gate_up_s,
                               tile=self.tile)
        return self._residual(gated, dw, x, down_s)

    def _residual(self, inputs: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, scale,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """A linear (with ``bias``, if any) and a residual addition; when folding, its squares are kept for the next
        norm."""
        if not self.fold:
            return decode_kernels.linear(inputs, weight, bias=bias, residual=residual, scale=scale, tile=self.tile)
        out, self.squares = decode_kernels.linear(inputs, weight, bias=bias, residual=residual, emit_squares=True,
                                                  scale=scale, tile=self.tile)
        return out

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return decode_kernels.rms_norm(x, weight, eps)

    def head(self, final: torch.Tensor) -> torch.Tensor:
        gen_head = self.decoder.model.gen_head
        return decode_kernels.linear(final, gen_head.weight, scale=getattr(gen_head, "weight_scale", None),
                                     tile=self.tile)


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
        compile_mode: str = "default",
        kernels: str = "torch",
        fold_norms: bool = False,
        shared_slots: bool = False,
        lane_rows: int | None = None,
        lane_attention: str = "auto",
    ) -> None:
        """``compile_mode``: torch.compile's mode for the layer bodies, e.g. "max-autotune-no-cudagraphs" (Inductor
        then times its own matmul kernels against cuBLAS for each shape: slower start). ``kernels``: "torch"
        (cuBLAS and torch's kernels, optionally compiled) or "triton" (``decode_kernels``: nine launches per
        layer, attention over each row's own length, hence no length buckets). ``fold_norms`` (triton): each
        residual linear emits its rows' partial sums of squares and the next linear applies the RMSNorm from
        them, so a layer is seven launches (1% faster per token on an H200, hence off). ``shared_slots``: allow
        ``step_lanes`` (several rows of one slot in a step; the triton kernels read each row's slot anyway, the torch
        kernels then read it as ``lane_attention`` says). ``lane_rows``: the rows one step of lanes may run (default: ``slots``),
        so that the lanes of many streams go in fewer, wider passes; more than ``slots`` needs ``shared_slots``, and
        with the triton kernels it sets the row tile of every step. ``lane_attention`` (torch kernels, steps of lanes):
        "gather" copies each row's slot out of the cache for the step (every layer, every row: at 256 rows of a 2,558-
        position Preview cache about 1.3 GB a layer, written and read again), "triton" has ``decode_kernels.attention``
        read each row's slot in place over its own length (one graph per row count, no length buckets);
        "triton-slots" reads each slot once for all of the step's rows of it (up to ``decode_kernels.lanes_per_group``),
        each over its own length, in steps of ``GROUPED_LANE_ROWS`` rows or more, and once a row in narrower ones;
        "auto" is triton-slots on a CUDA device where the triton package imports and its attention compiles and runs
        (``decode_kernels.probe_attention``), else gather, and gather with ``full_length``, whose steps of lanes must
        do the plain steps' arithmetic (so that speculative lanes draw the sequential grid)."""
        config = model.config
        lane_rows = slots if lane_rows is None else lane_rows
        if slots < 1 or max_positions < 2:
            raise ValueError("StaticDecoder needs at least one slot and two positions")
        if kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be 'torch' or 'triton', not {kernels!r}")
        if kernels == "triton" and not decode_kernels.available:
            raise ValueError("kernels='triton' needs the triton package")
        if kernels == "triton" and model.device.type != "cuda" and not decode_kernels.interpreting:
            raise ValueError("kernels='triton' needs a CUDA device")
        if lane_rows < slots:
            raise ValueError(f"lane_rows ({lane_rows}) must be at least the slots ({slots})")
        if lane_rows > slots and not shared_slots:
            raise ValueError("lane_rows beyond the slots is for steps of lanes: it needs shared_slots=True")
        if lane_rows > slots and full_length:
            # a row's arithmetic may depend on its step's row count: every step runs the same rows, or none is wider
            raise ValueError("full_length runs every step at the slots' rows: lane_rows must be the slots")
        if kernels == "triton" and lane_rows > decode_kernels.MAX_ROWS:
            raise ValueError(f"kernels='triton' takes at most {decode_kernels.MAX_ROWS} rows a step (slots and "
                             f"lane_rows), got {lane_rows}")
        if fold_norms and kernels != "triton":
            raise ValueError("fold_norms needs kernels='triton'")
        if lane_attention not in ("auto", "gather", *DIRECT_LANE_ATTENTION):
            raise ValueError(f"lane_attention must be 'auto', 'gather', 'triton' or 'triton-slots', not {lane_attention!r}")
        if lane_attention == "auto":
            direct = decode_kernels.available and model.device.type == "cuda" and not full_length
            if direct and kernels == "torch" and shared_slots:
                error = decode_kernels.probe_attention(model.device, model.dtype)
                if error is not None:
                    log.warning("steps of lanes gather their slots (the triton attention failed on %s: %s)",
                                model.device, error)
                    direct = False
            lane_attention = "triton-slots" if direct else "gather"
        elif lane_attention in DIRECT_LANE_ATTENTION and not (decode_kernels.available and (
                model.device.type == "cuda" or decode_kernels.interpreting)):
            raise ValueError(f"lane_attention={lane_attention!r} needs the triton package and a CUDA device")
        elif lane_attention in DIRECT_LANE_ATTENTION and full_length:
            raise ValueError("full_length steps of lanes attend as every other step does: lane_attention must be "
                             "'gather' or 'auto'")
        self.lane_attention = lane_attention
        self.kernels, self.fold_norms = kernels, fold_norms
        self.model, self.config = model, config
        # A free row: the first id a step may draw and take (config.gen_id_range) at the scratch position, drawing a
        # forced id (see _enqueue()).
        start = config.gen_id_range.start
        free_ints, self._free_floats = draw_columns(((start, start), SamplingParams(1.0, 1, 1.0), 0, 0))
        self._free_row = [start, max_positions - 1, *free_ints]  # and then its slot and its cache index
        self.slots, self.lane_rows = slots, lane_rows
        self.max_positions, self.full_length = max_positions, full_length
        device, dtype = model.device, model.dtype
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        text = model.model.language_model
        self.text = text
        layers, kv_heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        shape = (layers, slots, kv_heads, max_positions, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # The step's inputs, uploaded with one copy per dtype: columns of [lane_rows, 10] int64 (id, RoPE position,
        # then sample_rows' lo, hi, top_k, seed, step, partner, then the slot whose cache the row reads and writes,
        # and the cache index it writes at and attends up to) and [lane_rows, 3] float32 (temperature, top_p,
        # guidance). Row r is slot r's unless lanes share a slot (``step_lanes``); the cache index is the position
        # unless a decoding mode fills the cache in another order than the raster's (row-parallel decoding).
        self._long = torch.tensor([self._free_long(r) for r in range(lane_rows)], dtype=torch.long, device=device)
        self._float = torch.tensor([self._free_floats] * lane_rows, dtype=torch.float32, device=device)
        self.ids, self.positions = self._long[:, 0], self._long[:, 1]
        self.draws = RowSampling.from_columns(self._long[:, 2:8], self._float)
        self._rows, self.indexes = self._long[:, 8], self._long[:, 9]
        # Whether a step's rows may read another row's slot (lanes): the torch kernels then read each row's own slot
        # instead of viewing the first rows' (gathered or in place, in graphs of their own), so it is asked for at
        # construction.
        self.shared_slots = shared_slots
        self._free = list(range(slots))
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.lookahead = False  # see launch_ahead(); set by the owner
        self._ahead: _Ahead | None = None
        self.ahead_taken = self.ahead_wasted = 0  # steps launched ahead and then asked for, or not
        # Benchmarks set device_timing: the device's time of each step's upload and forward is then added to device_ms
        # (on a GPU CUDA events, read at the step's own wait; on the CPU, where the step runs as it is called, its
        # wall time), to set against the wall time of the token loop.
        self.device_timing = False
        self.device_ms = 0.0
        self._timed: list[DeviceTimer] = []
        self._indexes: dict[tuple[int, ...], torch.Tensor] = {}
        pinned = device.type == "cuda"
        self._host_drawn = torch.zeros(lane_rows, dtype=torch.long, pin_memory=pinned)
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the type torch.cuda.graph_pool_handle() returns
        self._side: torch.cuda.Stream | None = None  # where captures warm up (_capture)
        with torch.no_grad():
            fused = [self._weights(layer) for layer in text.layers]
        self._layer_weights = [weights for weights, _, _ in fused]
        # FP8 (servicekit.fp8, quantized at load): per layer the per-row scales of (q/k/v, o, gate/up, down)
        self._layer_scales: list[tuple | None] = [scales for _, scales, _ in fused]
        # Dev: per layer its q/k norms and o_proj's bias, where the layer has them
        self._layer_extras: list[_LayerExtras] = [extras for _, _, extras in fused]
        self.compile_mode = compile_mode
        self._kernels(compile)

    @property
    def lane_read(self) -> str:
        """How a step of lanes reads its rows' slots, in words (the service's start log)."""
        if self.kernels == "triton" or self.lane_attention == "triton":
            return "slots read in place, once a row"
        if self.lane_attention == "triton-slots":
            return f"slots read in place, once for a slot's rows in steps of {GROUPED_LANE_ROWS} rows or more"
        return "slots gathered"

    def _free_long(self, row: int) -> list[int]:
        """The integer columns of a free row placed at ``row``: it reads slot ``row`` (beyond the slots, a slot's
        again: rows of lanes), at the scratch position."""
        return [*self._free_row, row % self.slots, self.max_positions - 1]

    def _kernels(self, compile: bool) -> None:
        """The layers' kernel set and the sampler's noise: plain, or with torch.compile where it applies."""
        self.compiled = compile
        self.layers: _TritonLayers | _TorchLayers
        if self.kernels == "triton":
            self.layers = _TritonLayers(self, self.fold_norms)
        else:
            self.layers = _TorchLayers(self, compile, self.compile_mode, self.lane_attention)
        # Of the sampler only the noise (integer hashing, elementwise) is compiled: Inductor (torch 2.11) fails on
        # its sort/scan/argmax ("NYI TritonSplitDimKernel reductions"); those run unfused inside the graph.
        self._noise = torch.compile(gumbel_noise, dynamic=False, fullgraph=True) if compile else gumbel_noise

    def _weights(self, layer) -> tuple[tuple, tuple | None, _LayerExtras]:
        """The generation path's weights of one layer (expert copies where the layer has them), q/k/v and
        gate/up fused (q/k/v bias None where the model has none); when the layer's linears are FP8, their per-row
        scales (q/k/v, o, gate/up, down); and Dev's extras: the q/k norms fused (``_fuse_norms``) with
        ``config.qk_norm``, o_proj's bias with ``config.o_proj_bias``."""
        attn = layer.self_attn
        a = "gen_" if attn.experts else ""
        q, k, v, o = (getattr(attn, f"{a}{name}_proj") for name in ("q", "k", "v", "o"))
        extras = _LayerExtras(_fuse_norms(attn.q_norm, attn.k_norm) if self.config.qk_norm else None,
                              None if o.bias is None else o.bias.detach())
        mlp = layer.gen_mlp if layer.gen_mlp is not None else layer.mlp
        qkv_w, qkv_b, qkv_s = _fuse([q, k, v])
        gate_up_w, _, gate_up_s = _fuse([mlp.gate_proj, mlp.up_proj])
        weights = (
            layer.input_layernorm.weight, layer.input_layernorm.eps, qkv_w, qkv_b, o.weight,
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, gate_up_w,
            mlp.down_proj.weight,
        )
        scaled = [s is not None for s in (qkv_s, gate_up_s)]
        if not any(scaled):
            return weights, None, extras
        if not all(scaled):
            raise ValueError("a layer's linears must all be FP8 or all not")
        return weights, (qkv_s, o.weight_scale, gate_up_s, mlp.down_proj.weight_scale), extras

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
        for layer, (k, v) in enumerate(zip(cache._k, cache._v, strict=True)):
            assert k is not None and v is not None, "a prefilled cache holds every layer"
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
        indexes: list[int] | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """One token for each listed slot, fed ``ids`` at ``positions``; ``draws`` are ``sample_rows``' inputs
        (allowed range, params, seed, step) of the token each draws; ``indexes``: the cache index each row writes at
        and attends up to (default: its position). Returns (drawn ids, condition hidden states [B, H]) in the order
        given. When ``launch_ahead`` started exactly this step already, its result is taken."""
        indexes = positions if indexes is None else indexes
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead.request == (slots, ids, positions, draws, indexes):
                self.ahead_taken += 1
                result = ahead.result()
                self._add_device_time()
                return result
            self.ahead_wasted += 1
        drawn, hidden = self._enqueue(slots, ids, positions, draws, indexes)  # hidden: the listed slots' rows already
        tokens = drawn.tolist()  # the one device-to-host wait of a step
        self._add_device_time()
        return [tokens[slot] for slot in slots], hidden

    def _add_device_time(self) -> None:
        self.device_ms += sum(timer.seconds() for timer in self._timed) * 1000
        self._timed.clear()

    def launch_ahead(
        self,
        slots: list[int],
        ids: list[int],
        positions: list[int],
        draws: list[tuple[tuple[int, int], SamplingParams, int, int]],
        indexes: list[int] | None = None,
    ) -> bool:
        """Starts the step that will most likely be asked for next (the same streams, one token further) without
        waiting for it, so that the host's work between two steps overlaps the device's. ``step`` takes its result
        when asked for exactly these inputs and otherwise runs the step asked for: a step launched ahead only
        writes K/V at its streams' next positions, which the step run instead rewrites or no stream reads.
        Returns whether it launched (only into a graph already captured)."""
        indexes = positions if indexes is None else indexes
        self._ahead = None
        if not self.lookahead or not slots:
            return False
        try:
            self._check(ids, positions, indexes)
        except ValueError:
            return False
        if self.cuda_graphs and self.shape_for(slots, indexes) not in self._graphs:
            return False
        drawn, hidden = self._enqueue(slots, ids, positions, draws, indexes)
        self._ahead = _Ahead((slots, ids, positions, draws, indexes), drawn, hidden, self._host_drawn)
        return True

    def _check(self, ids: list[int], positions: list[int], indexes: list[int]) -> None:
        # A fed id is embedded as gen_embed_tokens[id - gen_vocab_start_index], and a drawn one is gen_logit_start
        # plus its column: gen_id_range holds the ids that are both (the two starts differ by Dev's skew).
        allowed = self.config.gen_id_range
        if min(ids) < allowed.start or max(ids) >= allowed.stop:
            raise ValueError("the fast decode step takes generation-vocabulary ids only")
        for name, values in (("position", positions), ("cache index", indexes)):
            bad = [v for v in values if not 0 <= v < self.max_positions - 1]
            if bad:
                raise ValueError(f"{name} {bad[0]} is beyond the decode cache ({self.max_positions - 1})")

    def step_lanes(
        self,
        slots: list[int],
        ids: list[int],
        positions: list[int],
        draws: list[tuple],
        indexes: list[int] | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """A step whose rows may share slots (decode lanes: several tokens of one stream): row r feeds ``ids[r]``
        rotated at ``positions[r]``, writes its K/V at cache index ``indexes[r]`` (default: its position) of slot
        ``slots[r]`` and attends over that slot's cache up to there; every row writes before any attends, so a lane
        sees the lanes before it. A guided draw's partner is the row of its unconditional logits. Rows are placed in
        the order given. Returns (drawn ids, hidden states [len(slots), H])."""
        if not self.shared_slots:
            raise ValueError("step_lanes needs a StaticDecoder built with shared_slots=True")
        self._ahead = None
        drawn, hidden = self._enqueue(slots, ids, positions, draws, positions if indexes is None else indexes,
                                      compact=True)
        tokens = drawn.tolist()
        self._add_device_time()
        return tokens[: len(slots)], hidden

    def _enqueue(self, slots, ids, positions, draws, indexes, compact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Uploads the inputs and runs (or enqueues, on CUDA) the step; returns its outputs (drawn ids, the listed
        slots' hidden states), which a later step does not overwrite. ``compact``: rows in the order given (lanes),
        not at their slots' rows."""
        if not (len(slots) == len(ids) == len(positions) == len(draws) == len(indexes)) or not slots:
            raise ValueError("step needs one id, one position, one draw and one cache index per slot")
        if compact:
            if len(slots) > self.lane_rows:
                raise ValueError(f"a step of lanes runs at most {self.lane_rows} rows; got {len(slots)}")
            if any(len(draw) > 4 and draw[4] > 1 and not 0 <= draw[5] < len(slots) for draw in draws):
                raise ValueError("a guided row's partner must be a row of the step")
        elif any(len(draw) > 4 and draw[4] > 1 and draw[5] not in slots for draw in draws):
            raise ValueError("a guided row's unconditional slot must step with it")
        self._check(ids, positions, indexes)
        places = list(range(len(slots))) if compact else slots
        bucket, rows, gather = self.shape_for(places, indexes, compact)
        # Free rows compute at the last position, which no real stream reaches (max_positions is one past the
        # longest prompt + grid), so their K/V writes never land on a real stream's positions; they draw a
        # forced id, unguided (their partner column, row 0, is read and ignored). A guided row's partner is the
        # slot of its unconditional row, which the caller lists in the same step.
        long_rows = [self._free_long(r) for r in range(rows)]
        float_rows = [self._free_floats] * rows
        for place, slot, token, position, draw, index in zip(places, slots, ids, positions, draws, indexes, strict=True):
            ints, float_rows[place] = draw_columns(draw, place)
            long_rows[place] = [token, position, *ints, slot, index]
        timer = DeviceTimer(self.device) if self.device_timing else None
        self._long[:rows].copy_(torch.tensor(long_rows, dtype=torch.long))
        self._float[:rows].copy_(torch.tensor(float_rows, dtype=torch.float32))
        if self.cuda_graphs:
            drawn, hidden = self._replay(bucket, rows, gather)
        else:
            drawn, hidden = self._forward(bucket, rows, gather)
        if timer is not None:
            timer.stop()
            self._timed.append(timer)
        # Copies, made in stream order before any later step overwrites a graph's output buffers. The row index
        # lives on the device already: an index built from a host list is a pageable upload, which waits for the
        # device to finish everything queued before it.
        if compact:
            return drawn.clone(), hidden[: len(slots)].clone()
        key = tuple(slots)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = torch.tensor(slots, dtype=torch.long, device=self.device)
        return drawn.clone(), hidden.index_select(0, index)

    def shape_for(self, slots: list[int], indexes: list[int], lanes: bool = False) -> tuple[int, int, bool]:
        """(bucket, rows, gather) of the step feeding ``slots`` at cache ``indexes``: rows up to the highest slot in use
        (a power of two; of a step of ``lanes``, up to its last row, at most ``lane_rows``), the length bucket covering
        the furthest index (none: the whole cache, where attention reads each row's own length), and whether the
        torch kernels run it as a step of lanes (each row reading its own slot); every slot and the whole cache when
        ``full_length``."""
        gather = lanes and self.layers.bucketed
        most = self.lane_rows if lanes else self.slots
        if self.full_length:
            return self.max_positions, self.slots, gather
        rows = min(most, 1 << max(slots).bit_length())
        if not self._bucketed(gather):
            return self.max_positions, rows, gather
        return min(self.max_positions, bucket_for(max(indexes) + 1)), rows, gather

    def warm_up(self, positions: int, lanes: bool = False) -> int:
        """Captures, up front, the graphs of every row count and every bucket up to ``positions`` (so that no
        request pays for a capture or a compilation); returns how many graphs there are. With the torch kernels, the
        graphs of steps of lanes (``gather``) only when ``lanes``: they double the count (over a hundred graphs, about
        two minutes of start-up at 64 rows), and otherwise each is captured the first time a step needs it."""
        if not self.cuda_graphs:
            return 0
        # torch.cuda.graph may collect garbage before each capture (torch.compiler.config.force_cudagraph_gc, the
        # default in some versions): with the objects alive now frozen out of the collector's reach, such a
        # collection only walks what was created since.
        gc.freeze()
        try:
            return self._capture_all(positions, lanes)
        finally:
            gc.unfreeze()

    def graph_keys(self, positions: int, lanes: bool = True) -> list[tuple[int, int, bool]]:
        """(bucket, rows, gather) of every step shape a batch of streams up to ``positions`` long can take: with
        ``shared_slots`` (unless not ``lanes``), the shapes of steps of lanes too, up to ``lane_rows`` rows (with the
        torch kernels each row count once more, as a step of lanes: per bucket when gathering, once with
        ``lane_attention`` "triton" or "triton-slots")."""
        shapes = [(rows, False) for rows in self.row_counts(self.slots)]
        if lanes and self.shared_slots:
            shapes += [(rows, self.layers.bucketed) for rows in self.row_counts(self.lane_rows)]
        shapes = list(dict.fromkeys(shapes))
        buckets: list[int] = []
        n = 1
        while n <= min(positions, self.max_positions):
            b = min(self.max_positions, bucket_for(n))
            if not buckets or b != buckets[-1]:
                buckets.append(b)
            n = b + 1
        if self.full_length:
            buckets = [self.max_positions]
        return [(bucket, rows, gather) for rows, gather in shapes
                for bucket in (buckets if self._bucketed(gather) else [self.max_positions])]

    def lane_groups(self, rows: torch.Tensor) -> torch.Tensor:
        """The step's rows (their slots, [P] on the device) as ``decode_kernels.attention``'s groups: the rows of one
        slot together, as many as one program of this model's heads reads the slot once for."""
        return decode_kernels.lane_groups(rows, decode_kernels.lanes_per_group(self.query_group), self.slots)

    def attention_workspace(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for ``decode_kernels.attention`` over ``rows`` rows of this model's heads."""
        config = self.config
        return decode_kernels.attention_workspace(rows, config.num_key_value_heads, self.query_group,
                                                  config.head_dim, self.device)

    @property
    def query_group(self) -> int:
        """The q heads sharing one kv head."""
        return self.config.num_attention_heads // self.config.num_key_value_heads

    def _bucketed(self, gather: bool) -> bool:
        """Whether a step's shape has a length bucket: the torch kernels' attention over the first positions of the
        rows' caches does; the triton kernels' attention (and, with ``lane_attention`` "triton" or "triton-slots", a
        step of lanes on the torch kernels) reads each row's own length, so one graph serves every length."""
        return self.layers.lanes_bucketed if gather else self.layers.bucketed

    def row_counts(self, most: int) -> list[int]:
        """The row counts a step of at most ``most`` rows may run: powers of two and ``most`` (only ``most`` when
        ``full_length``)."""
        if self.full_length:
            return [most]
        return sorted({min(most, 1 << n) for n in range(most.bit_length() + 1)})

    def _capture_all(self, positions: int, lanes: bool) -> int:
        for key in self.graph_keys(positions, lanes):
            if key not in self._graphs:
                self._capture(*key)
        return len(self._graphs)

    def _replay(self, bucket: int, rows: int, gather: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._graphs.get((bucket, rows, gather))
        if entry is None:
            entry = self._capture(bucket, rows, gather)
        graph, drawn, hidden = entry
        graph.replay()
        return drawn, hidden

    def _capture(self, bucket: int, rows: int, gather: bool = False):
        # Warm up on a side stream (compilation, cuBLAS workspaces), then capture. The inputs are saved and put
        # back: the warm-up runs write K/V at the rows' current cache indexes, which the real step rewrites.
        saved = self._long.clone()
        # One side stream for every capture: torch keeps a cuBLAS workspace for each stream a matmul has run on (for
        # the process's life), so warm-ups spread over torch's pool of streams would hold one each.
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            try:
                for _ in range(2):
                    self._forward(bucket, rows, gather)
            except Exception:
                if not self.compiled:
                    raise
                log.exception("torch.compile of the decode step failed; decoding with the plain kernels")
                self._kernels(False)
                for _ in range(2):
                    self._forward(bucket, rows, gather)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            drawn, hidden = self._forward(bucket, rows, gather)
        self._long.copy_(saved)
        key = (bucket, rows, gather)
        self._graphs[key] = (graph, drawn, hidden)
        log.info("captured the decode step for %d rows x %d positions%s (%d graphs)", rows, bucket,
                 ", lanes" if gather else "", len(self._graphs))
        return self._graphs[key]

    @torch.no_grad()
    def _forward(self, bucket: int, p: int, gather: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over the first ``p`` rows: (drawn ids [p], condition hidden states [p, H]). RoPE rotates at each
        row's position; K/V are written and read at its cache index. Never recorded by autograd, whoever calls it
        (the captures at start run outside the engine's inference mode): the model's weights require grad, and a
        recorded K/V write would chain every step's saved activations to the cache, which lives as long as the
        decoder."""
        config, text = self.config, self.text
        ids, positions, rows, indexes = self.ids[:p], self.positions[:p], self._rows[:p], self.indexes[:p]
        x = text.gen_embed_tokens(config.gen_embedding_row(ids))
        freqs = positions[:, None].float() * text.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [P, 1, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        keep = config.condition_layers
        n = len(text.layers)
        wanted = None if keep is None else {i % (n + 1) for i in keep}
        kept: dict[int, torch.Tensor] = {}
        layers = self.layers
        layers.start(cos, sin, indexes, rows, bucket, gather)
        for i, weights in enumerate(self._layer_weights):
            if wanted is not None and i in wanted:
                kept[i] = x
            x = layers.layer(i, weights, x)
        final = layers.norm(x, text.norm.weight, text.norm.eps)
        logits = layers.head(final)
        if keep is None:
            hidden = final
        else:
            # Entry N of the hidden-states tuple: the final norm (Preview) or the last layer's output as it is (Dev)
            kept[n] = final if config.final_hidden_normed else x
            hidden = torch.stack([kept[i % (n + 1)] for i in keep], dim=0).mean(dim=0)
        draws = RowSampling(*(getattr(self.draws, f)[:p] for f in RowSampling.__dataclass_fields__))
        # gen_head's column j is drawn as id gen_logit_start + j (the released code takes the logit index for the id)
        return sample_rows(logits, config.gen_logit_start, draws, self._noise), hidden
