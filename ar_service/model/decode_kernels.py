"""Triton kernels for the AR's decode step: few launches, each row computed on its own.

Why: at one to eight rows a decode step is a read of every weight once (13.3 GB for Preview), and the rest of
the step is the cost of launching and draining several hundred small kernels. These kernels fold the small
work into few launches: bias (where the model has one), SwiGLU and residual additions run in a linear layer's
epilogue, RoPE and the K/V cache write are one kernel (with Dev's per-head q/k RMSNorm before the rotation), RMSNorm
is one small kernel per row, and attention reads each row's own length from the device (no length buckets, so one
CUDA graph per row count). A layer is nine launches, Preview's and Dev's alike. (Folding the
RMSNorm into the linear kernel as a first pass over the input made the q/k/v projection 0.48 ms per step
instead of 0.31 on an H200: the weights start streaming only after that pass.)

Every row is computed independently of the others and with a block configuration that depends only on the
weight's shape, never on the row count: a row's result does not change with its batch-mates (bit for bit).

Numerics follow the eager model's roundings where they are cheap to follow (bf16 after each linear, after the
SwiGLU's activation, after each residual addition, after RMSNorm); reductions run in float32 in another order
than cuBLAS's, so results agree with the eager model to rounding, not to the bit.

Triton is optional: ``available`` says whether it imported. With ``TRITON_INTERPRET=1`` set before this module
is imported, the kernels run on CPU tensors (slowly), which is how the tests check them without a GPU.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from servicekit.triton_support import available, interpreting, tl, triton  # noqa: F401 (re-exported)

#: Row tiles of a tensor-core launch: tl.dot needs at least 16 rows; fewer rows are masked (their reads cost
#: nothing). A launch holds up to MAX_ROWS rows in one tile, so each weight is still read once for all of them.
DOT_TILES = (16, 32, 64)
#: Row tiles of the dot-free launch, taken by FP8 weights only (a decoder of one image: its conditional and
#: unconditional rows): each weight element is widened once and multiplied into each row on the CUDA cores, so no
#: widened tile goes through shared memory to reach a tensor core. On an H200 Preview's e4m3 linears take 22% less
#: time this way at 2 rows than the tensor-core kernel on the bf16 weights (2.76 against 3.56 ms a step; an earlier
#: form of the kernel took 26% more at 4 rows, docs/fp8.md).
#: A bf16 weight at this tile takes the tensor-core kernel at 16 rows (unchanged arithmetic).
GEMV_TILES = (2,)
ROW_TILES = GEMV_TILES + DOT_TILES
MAX_ROWS = ROW_TILES[-1]
#: Fixed split of each row's cached positions across programs in attention (flash-decoding): enough programs to
#: fill the GPU at one row, and fixed so that a row's reduction order depends only on its own length.
ATTENTION_SPLITS = 32
#: q rows one program of a step of lanes' attention computes (``lanes_per_group``): the lanes of one slot sharing a
#: read of its K/V times the heads of a kv head. 64 holds 9 lanes of Preview's 7 heads a kv head, about the most a
#: row-parallel stream at window 4 feeds in a step on the 32x32 grid (docs/speed-modes.md); a slot with more rows is
#: read once per 9. (Chosen from those shapes, not tuned on a GPU.)
LANE_TILE = 64


def row_tile(rows: int) -> int:
    """The smallest row tile that holds ``rows``. A decoder fixes it from its slot count, so that a row's
    arithmetic (the kernel, and the matrix-multiply instruction tl.dot picks for the tile) never depends on its
    batch-mates."""
    for tile in ROW_TILES:
        if rows <= tile:
            return tile
    raise ValueError(f"the triton kernels take at most {MAX_ROWS} rows, got {rows}")


def uses_gemv(weight: torch.Tensor, tile: int) -> bool:
    """Whether ``linear`` computes ``weight`` at row ``tile`` with the dot-free kernel: FP8 weights at GEMV_TILES."""
    return tile in GEMV_TILES and weight.dtype == torch.float8_e4m3fn


#: (BLOCK_N, BLOCK_K, warps, stages) of the dot-free kernel, for every FP8 weight (batch invariance: never a
#: function of the rows). From ``bench/decode_profile.py --tune --tune-rows 2`` on an H200 with Preview's shapes: one
#: warp per program holding two rows (and their up rows), 512 columns a step, three steps in flight, was the best or
#: within 4% of the best for every weight (bench/results/h200/fp8_gemv/NOTES.md).
GEMV_BLOCKS = (2, 512, 1, 3)


def default_blocks(weight: torch.Tensor, tile: int, swiglu: bool = False) -> tuple[int, int, int, int]:
    """The block shape ``linear`` launches ``weight`` with at row ``tile``: ``GEMV_BLOCKS`` or ``linear_blocks``."""
    n, k = weight.shape
    return GEMV_BLOCKS if uses_gemv(weight, tile) else linear_blocks(n, k, swiglu)


def linear_blocks(n: int, k: int, swiglu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an [n, k] weight: a function of the weight's shape only (batch
    invariance). From ``bench/decode_profile.py --tune`` on an H200 with Preview's shapes: narrow weights
    (o, down: 3,584 outputs) need narrower blocks to give every SM work; wide ones stream best in 64-row blocks
    (a SwiGLU program reads a 32-row gate block and a 32-row up block). A GPU with less shared memory gets
    fewer stages (see ``linear``)."""
    if swiglu:
        return 32, 256, 4, 5
    if n > 4096:
        return 64, 256, 4, 5
    return (32, 256, 4, 5) if k <= 4096 else (32, 512, 4, 4)


#: Stages that fit this GPU's shared memory, by launch configuration: found once per process by lowering the
#: stage count until the kernel compiles, so a configuration never changes with the rows in a batch.
_fitting_stages: dict[tuple, int] = {}


if available:

    @triton.jit
    def _linear_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, norm_ptr, squares_in_ptr, squares_out_ptr, scale_ptr,
        M, N, K, stride_x, stride_w, stride_out, stride_res, stride_squares_in, stride_squares_out, parts, eps,
        BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr, W_SCALE: tl.constexpr,
        SQUARES_OUT: tl.constexpr, PARTS_BLOCK: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out[:M, n] = f(x @ W[n]^T): N output columns per row; with SWIGLU, W holds N gate rows then N up rows and
        out = silu(gate) * up. NORM: x is RMS-normalised first, from the per-row partial sums of squares its
        producer left (``parts`` of them): norm(x) W^T = rstd * ((x * norm_weight) W^T). SQUARES_OUT: this
        program's partial sum of squares of its output columns goes to column ``program_id`` of squares_out.
        W_SCALE: W holds e4m3 values with one float32 scale per row (output channel) at scale_ptr: each tile is
        widened to x's dtype for the dot, and the float32 accumulator is multiplied by the column's scale.
        Without DOT (a few rows, FP8 weights): ``_gemv_products`` on the CUDA cores; its products are the dot's (exact
        in float32), summed in another order."""
        dtype = out_ptr.dtype.element_ty
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        if NORM:
            pp = tl.arange(0, PARTS_BLOCK)
            partial = tl.load(squares_in_ptr + rm[:, None] * stride_squares_in + pp[None, :],
                              mask=m_ok[:, None] & (pp < parts)[None, :], other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(partial, axis=1) / K + eps)
        if DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                k_ok = kk < K
                x = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if NORM:
                    x = x * tl.load(norm_ptr + kk, mask=k_ok, other=0.0)[None, :]
                w = tl.load(w_ptr + rn[:, None] * stride_w + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if W_SCALE:
                    w = w.to(x.dtype)
                acc = tl.dot(x, tl.trans(w), acc)
                if SWIGLU:
                    w_up = tl.load(w_ptr + (rn + N)[:, None] * stride_w + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    if W_SCALE:
                        w_up = w_up.to(x.dtype)
                    acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        else:
            acc, acc_up = _gemv_products(x_ptr, w_ptr, norm_ptr, M, N, K, stride_x, stride_w, NORM, SWIGLU,
                                         BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K)
        if W_SCALE:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
            if SWIGLU:
                acc_up = acc_up * tl.load(scale_ptr + N + rn, mask=n_ok, other=0.0)[None, :]
        if NORM:
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
        if SWIGLU:
            gate = out.to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(dtype) * acc_up.to(dtype)
        mask = m_ok[:, None] & n_ok[None, :]
        if RESIDUAL:
            res = tl.load(res_ptr + rm[:, None] * stride_res + rn[None, :], mask=mask, other=0.0)
            out = (out.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], out, mask=mask)
        if SQUARES_OUT:
            kept = tl.where(mask, out.to(tl.float32), 0.0)
            tl.store(squares_out_ptr + rm * stride_squares_out + tl.program_id(0), tl.sum(kept * kept, axis=1),
                     mask=m_ok)

    @triton.jit
    def _columns(pointers, kk, K, EVEN_K: tl.constexpr):
        """The values at ``pointers`` (columns ``kk``, broadcast to their shape): columns past K read as zero unless
        EVEN_K says there are none."""
        if EVEN_K:
            return tl.load(pointers)
        return tl.load(pointers, mask=kk < K, other=0.0)

    @triton.jit
    def _eighths(t):
        """The 8 elements of t's last axis (held by one thread) as 8 tensors of the leading axes."""
        a, b = tl.split(tl.reshape(t, t.shape[:-1] + [4, 2]))
        a0, a1 = tl.split(tl.reshape(a, a.shape[:-1] + [2, 2]))
        b0, b1 = tl.split(tl.reshape(b, b.shape[:-1] + [2, 2]))
        e0, e4 = tl.split(a0)
        e2, e6 = tl.split(a1)
        e1, e5 = tl.split(b0)
        e3, e7 = tl.split(b1)
        return e0, e1, e2, e3, e4, e5, e6, e7

    @triton.jit
    def _multiply_add8(acc, w, x):
        """acc + the products of the 8 ``_eighths`` of w and x, added one after another: one multiply-add each (a
        sum over the axis is a tree: half of its products are multiplies, and its adds come apart)."""
        acc = acc + w[0] * x[0]
        acc = acc + w[1] * x[1]
        acc = acc + w[2] * x[2]
        acc = acc + w[3] * x[3]
        acc = acc + w[4] * x[4]
        acc = acc + w[5] * x[5]
        acc = acc + w[6] * x[6]
        acc = acc + w[7] * x[7]
        return acc

    @triton.jit
    def _gemv_products(
        x_ptr, w_ptr, norm_ptr, M, N, K, stride_x, stride_w,
        NORM: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        """x [:M] (M <= 2) times the e4m3 rows [N] of this program (and their up rows), float32 [2, BLOCK_N] each,
        on the CUDA cores. The K axis is cut into groups of 8 (8 bytes of e4m3, 16 of bf16 x: both tensors share
        one register layout); a thread holds the same groups of every weight row of its program, so each input
        element is loaded, normalised and widened once per thread and multiplied into all BLOCK_N rows from
        registers. A group's 8 products are added one after another into the thread's accumulator for that group
        (one multiply-add each: a sum over the axis would add them as a tree), and the accumulators across threads
        once after the loop. Rows past N re-read row N - 1 (never stored): no mask in the loop; K takes a mask only
        when BLOCK_K does not divide it (EVEN_K)."""
        tl.static_assert(BLOCK_M == 2)
        GROUP: tl.constexpr = 8
        G: tl.constexpr = BLOCK_K // GROUP
        rn = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
        kg = tl.arange(0, G)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        w_rows = w_ptr + rn[:, None, None] * stride_w + kg[None, :, :]
        up_rows = w_rows + N * stride_w
        x1_ptr = x_ptr + tl.minimum(M - 1, 1) * stride_x  # a lone row is read twice; its second result is not stored
        acc0 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        up0 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        up1 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kk = k0 + kg
            x0 = _columns(x_ptr + kk, kk, K, EVEN_K)
            x1 = _columns(x1_ptr + kk, kk, K, EVEN_K)
            w = _columns(w_rows + k0, kk, K, EVEN_K)
            if NORM:
                nw = _columns(norm_ptr + kk, kk, K, EVEN_K)
                x0 = x0 * nw
                x1 = x1 * nw
            x0 = _eighths(x0.to(tl.float32)[None, :, :])
            x1 = _eighths(x1.to(tl.float32)[None, :, :])
            wf = _eighths(w.to(tl.float32))
            acc0 = _multiply_add8(acc0, wf, x0)
            acc1 = _multiply_add8(acc1, wf, x1)
            if SWIGLU:
                uf = _eighths(_columns(up_rows + k0, kk, K, EVEN_K).to(tl.float32))
                up0 = _multiply_add8(up0, uf, x0)
                up1 = _multiply_add8(up1, uf, x1)
        first = tl.arange(0, BLOCK_M)[:, None] == 0
        acc = tl.where(first, tl.sum(acc0, axis=1)[None, :], tl.sum(acc1, axis=1)[None, :])
        acc_up = tl.where(first, tl.sum(up0, axis=1)[None, :], tl.sum(up1, axis=1)[None, :])
        return acc, acc_up

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, stride_x, stride_out, eps, BLOCK_K: tl.constexpr):
        """weight * (x / rms(x)) of one row, rounded as the eager model rounds (normalised row to bf16 first)."""
        r = tl.program_id(0)
        k = tl.arange(0, BLOCK_K)
        ok = k < K
        x = tl.load(x_ptr + r * stride_x + k, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
        weight = tl.load(w_ptr + k, mask=ok, other=0.0)
        tl.store(out_ptr + r * stride_out + k, (xf * rstd).to(x.dtype) * weight, mask=ok)

    @triton.jit
    def _rope_write_kernel(
        qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, norm_ptr,
        stride_qkv, stride_cs, stride_q, stride_slot, stride_head, stride_pos, eps,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    ):
        """Rotates row r's head h of the fused q/k/v output; q heads go to ``q``, k and v heads into the cache at the
        row's position (v unrotated). NORM (per-head q/k RMSNorm, Qwen3): a q or k head is first normalised over its
        head_dim values (float32 variance, rounded to the activation dtype, times the weight: the q norm's weight at
        norm_ptr[:2 HALF], the k norm's at norm_ptr[2 HALF:]), then rotated."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        src = qkv_ptr + r * stride_qkv + h * 2 * HALF
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        position = tl.load(pos_ptr + r)
        slot = tl.load(slot_ptr + r)
        cache = slot * stride_slot + position * stride_pos
        if h < HEADS + KV_HEADS:
            if NORM:
                f1 = x1.to(tl.float32)
                f2 = x2.to(tl.float32)
                rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
                weight = norm_ptr + tl.where(h < HEADS, 0, 2 * HALF)
                x1 = ((f1 * rstd).to(x1.dtype) * tl.load(weight + d)).to(x1.dtype)
                x2 = ((f2 * rstd).to(x2.dtype) * tl.load(weight + HALF + d)).to(x2.dtype)
            cos1 = tl.load(cos_ptr + r * stride_cs + d)
            cos2 = tl.load(cos_ptr + r * stride_cs + HALF + d)
            sin1 = tl.load(sin_ptr + r * stride_cs + d)
            sin2 = tl.load(sin_ptr + r * stride_cs + HALF + d)
            # x * cos + rotate_half(x) * sin, rounded after each operation as the eager model's bf16 ops are
            y1 = (x1 * cos1).to(x1.dtype) + (-x2 * sin1).to(x1.dtype)
            y2 = (x2 * cos2).to(x1.dtype) + (x1 * sin2).to(x1.dtype)
            if h < HEADS:
                dst = q_ptr + r * stride_q + h * 2 * HALF
            else:
                dst = k_ptr + cache + (h - HEADS) * stride_head
            tl.store(dst + d, y1.to(x1.dtype))
            tl.store(dst + HALF + d, y2.to(x1.dtype))
        else:
            dst = v_ptr + cache + (h - HEADS - KV_HEADS) * stride_head
            tl.store(dst + d, x1)
            tl.store(dst + HALF + d, x2)

    @triton.jit
    def _attend_split(q, k_ptr, v_ptr, start, end, length, stride_pos, scale, M: tl.constexpr, D: tl.constexpr,
                      BLOCK_P: tl.constexpr, ROW_LENGTHS: tl.constexpr):
        """Online softmax of q [M, D] over the positions [start, end) of one slot's K/V (pointers at its kv head):
        (unnormalised output, running max, sum), as both attention kernels keep them. With ``ROW_LENGTHS`` q row m
        sees only the positions below length[m], so it may see none of a block: its max stays -inf and it shifts
        by 0 (not -inf - -inf). Without, every row sees every position of the split (``length`` unread)."""
        d = tl.arange(0, D)
        m_i = tl.full([M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([M], dtype=tl.float32)
        acc = tl.zeros([M, D], dtype=tl.float32)
        for p0 in range(start, end, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_ok = p < end
            k = tl.load(k_ptr + p[:, None] * stride_pos + d[None, :], mask=p_ok[:, None], other=0.0)
            v = tl.load(v_ptr + p[:, None] * stride_pos + d[None, :], mask=p_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            if ROW_LENGTHS:
                s = tl.where(p_ok[None, :] & (p[None, :] < length[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                shift = tl.where(m_new > float("-inf"), m_new, 0.0)
            else:
                s = tl.where(p_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                shift = m_new
            alpha = tl.exp(m_i - shift)
            probs = tl.exp(s - shift[:, None])
            l_i = l_i * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attention_split_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, acc_ptr, stats_ptr,
        stride_q, stride_slot, stride_head, stride_pos, scale, free_position,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Partial attention of the q heads sharing kv head ``kvh`` over one split of the row's positions
        [0, position]: unnormalised output, running max and sum (flash-decoding)."""
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        position = tl.load(pos_ptr + r)
        length = tl.where(position >= free_position, 1, position + 1)  # a free row reads one position
        slot = tl.load(slot_ptr + r)
        chunk = tl.cdiv(length, SPLITS)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + r * stride_q + (kvh * GROUP + g)[:, None] * D + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        base = slot * stride_slot + kvh * stride_head
        acc, m_i, l_i = _attend_split(q, k_ptr + base, v_ptr + base, start, end, length, stride_pos, scale, BLOCK_G, D,
                                      BLOCK_P, False)
        part = (r * kv_heads + kvh) * SPLITS + split
        tl.store(acc_ptr + part * BLOCK_G * D + g[:, None] * D + d[None, :], acc)
        tl.store(stats_ptr + part * 2 * BLOCK_G + g, m_i)
        tl.store(stats_ptr + part * 2 * BLOCK_G + BLOCK_G + g, l_i)

    @triton.jit
    def _attention_lanes_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, group_ptr, acc_ptr, stats_ptr,
        stride_q, stride_group, stride_slot, stride_head, stride_pos, scale, free_position,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
        BLOCK_P: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """``_attention_split_kernel`` for a group of up to LANES rows of one slot: each K/V block of the split is read
        once for the q heads of kv head ``kvh`` of all of them (tile row m: lane m // GROUP, head m % GROUP), each
        tile row masked to its own row's length. The split follows the group's longest row, so a shorter row may see
        no position in a block (its running max stays -inf, and the shifts use 0 instead). Each row's partials land
        where the per-row kernel puts them, so the same combine joins them; an empty group stores nothing."""
        grp = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        m = tl.arange(0, BLOCK_M)
        lane = m // GROUP
        gi = m % GROUP
        row = tl.load(group_ptr + grp * stride_group + lane, mask=lane < LANES, other=-1)
        ok = row >= 0
        row = tl.where(ok, row, 0)
        position = tl.load(pos_ptr + row, mask=ok, other=0)
        length = tl.where(ok, tl.where(position >= free_position, 1, position + 1), 0)  # a free row reads one
        longest = tl.max(length, axis=0)
        slot = tl.max(tl.load(slot_ptr + row, mask=ok, other=0), axis=0)  # the group's rows share it
        chunk = tl.cdiv(longest, SPLITS)
        start = split * chunk
        end = tl.minimum(start + chunk, longest)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row[:, None] * stride_q + (kvh * GROUP + gi)[:, None] * D + d[None, :], mask=ok[:, None],
                    other=0.0)
        base = slot * stride_slot + kvh * stride_head
        acc, m_i, l_i = _attend_split(q, k_ptr + base, v_ptr + base, start, end, length, stride_pos, scale, BLOCK_M, D,
                                      BLOCK_P, True)
        part = (row * kv_heads + kvh) * SPLITS + split
        tl.store(acc_ptr + (part * BLOCK_G + gi)[:, None] * D + d[None, :], acc, mask=ok[:, None])
        tl.store(stats_ptr + part * 2 * BLOCK_G + gi, m_i, mask=ok)
        tl.store(stats_ptr + part * 2 * BLOCK_G + BLOCK_G + gi, l_i, mask=ok)

    @triton.jit
    def _attention_combine_kernel(
        acc_ptr, stats_ptr, out_ptr, stride_out,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Joins the splits of row r's q head h into its attention output (bf16)."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        kv_heads = tl.num_programs(1) // GROUP
        kvh = h // GROUP
        gi = h % GROUP
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        part = (r * kv_heads + kvh) * SPLITS + s
        m = tl.load(stats_ptr + part * 2 * BLOCK_G + gi)
        denom = tl.load(stats_ptr + part * 2 * BLOCK_G + BLOCK_G + gi)
        top = tl.max(m, axis=0)
        weight = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
        acc = tl.load(acc_ptr + (part * BLOCK_G + gi)[:, None] * D + d[None, :])
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
        tl.store(out_ptr + r * stride_out + h * D + d, out.to(out_ptr.dtype.element_ty))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [M, K], one program per row (a row's result never depends on the others)."""
    m, k = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(m,)](x, weight, out, k, x.stride(0), out.stride(0), eps, BLOCK_K=triton.next_power_of_2(k),
                           num_warps=8)
    return out


@overload
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = ...,
    norm: tuple[torch.Tensor, float] | None = ...,
    squares: torch.Tensor | None = ...,
    residual: torch.Tensor | None = ...,
    swiglu: bool = ...,
    emit_squares: Literal[False] = ...,
    blocks: tuple[int, int, int, int] | None = ...,
    scale: torch.Tensor | None = ...,
    tile: int | None = ...,
) -> torch.Tensor: ...


@overload
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = ...,
    norm: tuple[torch.Tensor, float] | None = ...,
    squares: torch.Tensor | None = ...,
    residual: torch.Tensor | None = ...,
    swiglu: bool = ...,
    emit_squares: Literal[True],
    blocks: tuple[int, int, int, int] | None = ...,
    scale: torch.Tensor | None = ...,
    tile: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    squares: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    emit_squares: bool = False,
    blocks: tuple[int, int, int, int] | None = None,
    scale: torch.Tensor | None = None,
    tile: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (M <= 64) through an [N, K] weight with the folded extras: ``bias``, ``swiglu`` (weight = gate
    rows then up rows: the result is silu(gate) * up, N/2 wide) and ``residual`` added to the result.

    ``norm`` (RMSNorm weight, eps) normalises the input first: in its own launch, or, given the ``squares`` that
    the linear which produced ``x`` emitted, inside this one. ``emit_squares``: also return the per-row partial
    sums of squares of the result (float32 [tile, programs]) for the next linear's norm. A row's sum is always
    taken in the same order, whatever the other rows. ``blocks`` overrides ``linear_blocks`` (for tuning).
    ``scale``: the weight is FP8 (e4m3, ``servicekit.fp8.quantize_weight``) with these float32 per-row scales [N]
    (a SwiGLU weight's gate rows, then its up rows); the product is computed in float32 and scaled per column.
    ``tile``: the rows one launch computes together (one of ``ROW_TILES``, at least M; default ``row_tile(M)``); an
    FP8 weight at a tile of GEMV_TILES takes the dot-free kernel (``GEMV_BLOCKS``)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"linear takes at most {MAX_ROWS} rows of width {weight.shape[1]}, got {tuple(x.shape)}")
    tile = row_tile(m) if tile is None else tile
    if tile not in ROW_TILES or m > tile:
        raise ValueError(f"tile must be one of {ROW_TILES} and hold the {m} rows, got {tile}")
    if squares is not None and norm is None:
        raise ValueError("squares are only read with norm")
    if (scale is not None) != (weight.dtype == torch.float8_e4m3fn) or (scale is not None and scale.shape != weight.shape[:1]):
        raise ValueError("an e4m3 weight needs its float32 scales, one per row, and only an e4m3 weight takes them")
    if norm is not None and squares is None:
        x, norm = rms_norm(x, *norm), None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gemv = uses_gemv(weight, tile)
    block_m = tile if gemv else max(tile, DOT_TILES[0])
    block_n, block_k, warps, stages = blocks or default_blocks(weight, tile, swiglu)
    programs = triton.cdiv(n, block_n)
    squares_out = torch.empty((tile, programs), dtype=torch.float32, device=x.device) if emit_squares else None
    norm_w, eps = norm if norm is not None else (x, 0.0)
    flags = dict(BIAS=bias is not None, RESIDUAL=residual is not None, SWIGLU=swiglu, NORM=norm is not None,
                 SQUARES_OUT=emit_squares, W_SCALE=scale is not None)
    parts = squares.shape[1] if squares is not None else 1
    key = (x.device, x.dtype, weight.dtype, block_m, block_n, block_k, warps, stages, *flags.values())
    stages = _fitting_stages.get(key, stages)
    while True:
        try:
            _linear_kernel[(programs,)](
                x, weight, out, bias if bias is not None else x, residual if residual is not None else x, norm_w,
                squares if squares is not None else out, squares_out if squares_out is not None else out,
                scale if scale is not None else out,
                m, n, k, x.stride(0), weight.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
                squares.stride(0) if squares is not None else 0, squares_out.stride(0) if squares_out is not None else 0,
                parts, eps, **flags, PARTS_BLOCK=triton.next_power_of_2(parts), DOT=not gemv, EVEN_K=k % block_k == 0,
                STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
            )
        except triton.runtime.errors.OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _fitting_stages[key] = stages
        return (out, squares_out) if squares_out is not None else out  # squares_out is made when emit_squares


def rope_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
    qk_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """RoPE on the fused q/k/v rows [P, (heads + 2 kv_heads) D]; writes k and v into ``k_cache``/``v_cache``
    [slots, kv_heads, positions, D] at each row's slot and position; returns q [P, heads, D]. ``qk_norm`` (weight
    [2 D]: the q norm's D values then the k norm's, and eps): each q and k head is RMS-normalised over its D values
    before it is rotated (Qwen3's q_norm / k_norm), in the same launch."""
    p = qkv.shape[0]
    d = cos.shape[-1]
    _rows_contiguous(positions, slots)
    if qkv.shape[1] != (heads + 2 * kv_heads) * d:
        raise ValueError(f"q/k/v rows of width {qkv.shape[1]} do not hold {heads} + 2 x {kv_heads} heads of {d}")
    if qk_norm is not None and (qk_norm[0].shape != (2 * d,) or not qk_norm[0].is_contiguous()):
        raise ValueError(f"the q/k norm weight must be one contiguous vector of 2 x {d} values")
    norm_w, eps = qk_norm if qk_norm is not None else (qkv, 0.0)
    q = torch.empty((p, heads, d), dtype=qkv.dtype, device=qkv.device)
    _rope_write_kernel[(p, heads + 2 * kv_heads)](
        qkv, cos, sin, positions, slots, q, k_cache, v_cache, norm_w,
        qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        HEADS=heads, KV_HEADS=kv_heads, HALF=d // 2, NORM=qk_norm is not None, num_warps=1,
    )
    return q


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    scale: float, workspace: tuple[torch.Tensor, torch.Tensor] | None = None, free_position: int | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's q [P, heads, D] over its slot's cached positions [0, position]: [P, heads * D]. Rows at
    ``free_position`` or beyond (padding rows, whose output nobody reads) attend to one position only.

    ``groups`` (``lane_groups``: rows of one slot, every row in exactly one group): each group's programs read its
    slot's K/V once for all of its rows instead of once per row (a step of lanes, where several rows share a slot).
    The result equals the per-row read's up to float reordering; the split of a row's positions follows its group's
    longest row, so a row's bits may change with its group-mates (the per-row read's do not)."""
    p, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    _rows_contiguous(positions, slots)
    group = heads // kv_heads
    block_g = query_tile(group)
    if workspace is None:
        workspace = attention_workspace(p, kv_heads, group, d, q.device)
    acc, stats = workspace
    free_position = k_cache.shape[2] if free_position is None else free_position
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale, free_position)
    if groups is None:
        _attention_split_kernel[(p, kv_heads, ATTENTION_SPLITS)](
            q, k_cache, v_cache, positions, slots, acc, stats, q.stride(0), *strides,
            GROUP=group, BLOCK_G=block_g, D=d, BLOCK_P=64, SPLITS=ATTENTION_SPLITS, num_warps=4, num_stages=2,
        )
    else:
        _launch_lanes(q, k_cache, v_cache, positions, slots, groups, acc, stats, strides, group, block_g)
    out = torch.empty((p, heads * d), dtype=q.dtype, device=q.device)
    _attention_combine_kernel[(p, heads)](
        acc, stats, out, out.stride(0), GROUP=group, BLOCK_G=block_g, D=d, SPLITS=ATTENTION_SPLITS, num_warps=1,
    )
    return out


def _launch_lanes(q, k_cache, v_cache, positions, slots, groups, acc, stats, strides, group: int, block_g: int) -> None:
    """``_attention_lanes_kernel`` over (group, kv head, split): a tile of every q head of a kv head of a group's
    rows, LANES * GROUP rows padded to a power of two (at least 16, what tl.dot takes)."""
    if groups.dim() != 2 or groups.dtype != torch.int32 or groups.stride(1) != 1:
        raise ValueError("groups must be an int32 [groups, lanes] table with contiguous rows (lane_groups)")
    lanes = groups.shape[1]
    _attention_lanes_kernel[(groups.shape[0], k_cache.shape[1], ATTENTION_SPLITS)](
        q, k_cache, v_cache, positions, slots, groups, acc, stats, q.stride(0), groups.stride(0), *strides,
        GROUP=group, BLOCK_G=block_g, LANES=lanes, BLOCK_M=query_tile(lanes * group),
        D=q.shape[2], BLOCK_P=64, SPLITS=ATTENTION_SPLITS, num_warps=4, num_stages=2,
    )


def lanes_per_group(group: int) -> int:
    """The rows of one slot that ``attention`` reads the slot once for: as many as LANE_TILE q rows hold."""
    return max(1, LANE_TILE // group)


def lane_groups(slots: torch.Tensor, lanes: int, slot_count: int) -> torch.Tensor:
    """The rows of a step, by their ``slots`` [P] (each below ``slot_count``), as groups of up to ``lanes`` rows of
    one slot for ``attention``'s ``groups``: int32 [groups, lanes] row indexes, -1 past a group's rows. Device
    operations of fixed shapes for a row count (a captured graph recomputes it at each replay, whatever the step's
    slots); the table holds as many groups as any step of P rows can need (``max_lane_groups``), the rest empty."""
    p = slots.shape[0]
    order = torch.sort(slots, stable=True).indices
    ordered = slots[order]
    index = torch.arange(p, device=slots.device)
    first = torch.cat((index[:1] == 0, ordered[1:] != ordered[:-1]))  # the first row of each slot, in slot order
    within = index - torch.where(first, index, 0).cummax(0).values  # the row's place among its slot's rows
    group = (within % lanes == 0).cumsum(0) - 1
    table = torch.full((max_lane_groups(p, lanes, slot_count), lanes), -1, dtype=torch.int32, device=slots.device)
    table[group, within % lanes] = order.to(torch.int32)
    return table


def max_lane_groups(rows: int, lanes: int, slot_count: int) -> int:
    """The most groups of up to ``lanes`` rows of one slot that ``rows`` rows over ``slot_count`` slots make: a slot
    of n rows makes ceil(n / lanes) <= (n + lanes - 1) / lanes of them, and at most min(rows, slot_count) slots have
    rows. Empty groups still launch their programs, so the table is no larger than that."""
    used = min(rows, slot_count)
    return min(rows, (rows + used * (lanes - 1)) // lanes)


def query_tile(rows: int) -> int:
    """The q rows an attention program computes, padded to a power of two of at least 16 (what tl.dot takes)."""
    return max(16, 1 << (rows - 1).bit_length())


def attention_workspace_bytes(rows: int, kv_heads: int, group: int, d: int) -> int:
    """The size of ``attention_workspace`` (the memory estimate's share of a step, without allocating it)."""
    block_g = query_tile(group)
    return rows * kv_heads * ATTENTION_SPLITS * (block_g * d + 2 * block_g) * 4


def attention_workspace(rows: int, kv_heads: int, group: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for ``attention``'s partial results (float32), reusable across layers of one step."""
    block_g = query_tile(group)
    parts = rows * kv_heads * ATTENTION_SPLITS
    return (torch.empty((parts, block_g, d), dtype=torch.float32, device=device),
            torch.empty((parts, 2, block_g), dtype=torch.float32, device=device))


def _rows_contiguous(*vectors: torch.Tensor) -> None:
    """The kernels index per-row vectors as plain arrays."""
    if any(v.shape[0] > 1 and v.stride(0) != 1 for v in vectors):
        raise ValueError("positions and slots must be contiguous vectors")


def probe(device: torch.device, dtype: torch.dtype, fp8: bool = False, tile: int = ROW_TILES[0]) -> Exception | None:
    """Compiles and runs every kernel once on small tensors of ``dtype`` on ``device`` (the linear kernel at row
    ``tile``, and with FP8 weights when ``fp8``): None when they work, else the error (e.g. a GPU whose Triton
    backend has no ``dtype`` matrix multiply)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        x, w = rand(2, 64), rand(64, 64)
        linear(linear(x, w, bias=rand(64), norm=(rand(64), 1e-6), swiglu=True, tile=tile), rand(64, 32), residual=x,
               tile=tile)
        _run_attention(rand)
        if fp8:
            from servicekit.fp8 import quantize_weight

            gate_up, gate_up_scale = quantize_weight(rand(64, 64))
            down, down_scale = quantize_weight(rand(64, 32))
            linear(linear(x, gate_up, norm=(rand(64), 1e-6), swiglu=True, scale=gate_up_scale, tile=tile), down,
                   residual=x, scale=down_scale, tile=tile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # any failure means: use the torch kernels
        return error
    return None


def probe_attention(device: torch.device, dtype: torch.dtype) -> Exception | None:
    """``probe`` for the attention kernels alone (both reads, and the RoPE write that feeds them): what the torch
    kernels' steps of lanes use to read their slots in place. None when they work, else the error."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        _run_attention(lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # any failure means: gather the rows' slots instead
        return error
    return None


def _run_attention(rand) -> None:
    """The RoPE write and both attention reads, once each on small tensors from ``rand(*shape)``."""
    heads, kv_heads, d = 2, 1, 16
    device = rand(1).device
    cache = rand(2, kv_heads, 8, d), rand(2, kv_heads, 8, d)
    rows = torch.arange(2, device=device)
    q = rope_write(rand(2, (heads + 2 * kv_heads) * d), rand(2, d), rand(2, d), rows + 3, rows, *cache, heads, kv_heads)
    attention(q, *cache, rows + 3, rows, 0.25)
    attention(q, *cache, rows + 3, rows, 0.25, groups=lane_groups(rows, 2, 2))
    rope_write(rand(2, (heads + 2 * kv_heads) * d), rand(2, d), rand(2, d), rows + 3, rows, *cache, heads, kv_heads,
               qk_norm=(rand(2 * d), 1e-6))
