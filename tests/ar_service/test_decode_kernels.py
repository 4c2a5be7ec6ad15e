"""The Triton decode kernels against torch's operations, and the decode step built on them.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets it up), on float32 and float16
CPU tensors; the decode step on them is checked against the step on torch's kernels and for batch invariance.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from ar_service.conditions import prompt_ids_for
from ar_service.decoding.decoders import SlotDecoder, decode_together
from ar_service.decoding.stream import DecodeStream
from ar_service.generation import generate_grid
from ar_service.model import decode_kernels
from ar_service.model.static_decode import StaticDecoder, _attend, _rms_norm, _rotate, resolve_decode_kernels
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams


@pytest.fixture
def few_splits(monkeypatch):
    """Two attention splits instead of 32: the interpreter runs programs one by one, and the split/combine logic
    is the same for any count."""
    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", 2)


pytestmark = pytest.mark.skipif(not decode_kernels.available, reason="triton is not installed (no wheel for this platform)")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_linear_folds_norm_bias_swiglu_and_residual(dtype, rows):
    """Each folded extra gives what the eager model's separate operations give; blocks smaller than the weight
    so that the K loop runs several times and the last column block is partly masked."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(40, 96, generator=g) * 0.1).to(dtype)
    bias, norm_w = torch.randn(40, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    residual = torch.randn(rows, 40, generator=g).to(dtype)
    blocks = (16, 32, 4, 1)
    tol = TOLERANCE[dtype]

    def ref(*args):  # the eager model's operations in float32, rounded like it at the end
        return [a.float() for a in args]

    got = decode_kernels.linear(x, w, bias=bias, norm=(norm_w, 1e-6), residual=residual, blocks=blocks)
    xf, wf, bf, nf, rf = ref(x, w, bias, norm_w, residual)
    torch.testing.assert_close(got.float(), rf + F.linear(_rms_norm(xf, nf, 1e-6), wf, bf), **tol)

    got = decode_kernels.linear(x, w, swiglu=True, blocks=blocks)
    gate, up = F.linear(xf, wf).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, **tol)
    assert got.shape == (rows, 20)

    got = decode_kernels.linear(x, w)  # the default blocks, wider than this weight
    torch.testing.assert_close(got.float(), F.linear(xf, wf), **tol)

    got = decode_kernels.rms_norm(x, norm_w, 1e-6)
    torch.testing.assert_close(got.float(), _rms_norm(xf, nf, 1e-6), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_norm_folded_from_the_producers_squares_equals_its_own_launch(dtype):
    """A residual linear emits its rows' partial sums of squares; the next linear normalises its input from them
    and gives what the separate RMSNorm launch gives, within rounding."""
    g = torch.Generator().manual_seed(2)
    x, residual = torch.randn(3, 48, generator=g).to(dtype), torch.randn(3, 40, generator=g).to(dtype)
    w1, w2 = (torch.randn(40, 48, generator=g) * 0.2).to(dtype), (torch.randn(24, 40, generator=g) * 0.2).to(dtype)
    norm = (torch.randn(40, generator=g).to(dtype), 1e-6)
    blocks = (16, 32, 4, 1)
    h, squares = decode_kernels.linear(x, w1, residual=residual, emit_squares=True, blocks=blocks)
    assert squares.shape == (16, 3)  # a partial sum per row of the 16-row tile and per program of 16 columns
    torch.testing.assert_close(squares[:3].sum(dim=1), h.float().pow(2).sum(dim=1), **TOLERANCE[dtype])
    assert torch.equal(h, decode_kernels.linear(x, w1, residual=residual, blocks=blocks))
    folded = decode_kernels.linear(h, w2, norm=norm, squares=squares, blocks=blocks)
    separate = decode_kernels.linear(h, w2, norm=norm, blocks=blocks)
    torch.testing.assert_close(folded.float(), separate.float(), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="only read with norm"):
        decode_kernels.linear(h, w2, squares=squares)


def test_linear_refuses_more_rows_than_one_launch_holds():
    with pytest.raises(ValueError, match="at most 64 rows"):
        decode_kernels.linear(torch.zeros(65, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="hold the 17 rows"):
        decode_kernels.linear(torch.zeros(17, 8), torch.zeros(4, 8), tile=16)
    with pytest.raises(ValueError, match="one of"):
        decode_kernels.linear(torch.zeros(2, 8), torch.zeros(4, 8), tile=24)


@pytest.mark.parametrize("tile", [16, 64])
def test_a_row_gives_the_same_bits_alone_and_among_many_at_one_tile(tile):
    """Batch invariance of the linear: at a fixed row tile a row's result does not depend on the rows beside it
    (the decoder fixes the tile from its slots, so 1 row and 40 rows run the same arithmetic)."""
    g = torch.Generator().manual_seed(3)
    rows = min(tile, 40)
    x = torch.randn(rows, 96, generator=g).to(torch.float16)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(torch.float16)
    together = decode_kernels.linear(x, w, swiglu=True, tile=tile)
    for r in (0, rows - 1):
        assert torch.equal(decode_kernels.linear(x[r:r + 1], w, swiglu=True, tile=tile), together[r:r + 1])


def test_the_row_tile_is_the_smallest_that_holds_the_rows():
    rows = (1, 2, 3, 16, 17, 32, 33, 64)
    assert [decode_kernels.row_tile(r) for r in rows] == [2, 2, 16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="at most 64 rows"):
        decode_kernels.row_tile(65)


@pytest.mark.parametrize("splits", [2, 32])
def test_rope_write_and_attention_match_the_torch_step(monkeypatch, splits):
    """RoPE lands in q and in the cache at each row's slot and position; attention over each row's own length
    equals the masked attention of the torch step, with more splits than positions (empty splits) too. A row at
    the free position reads one position and stays finite."""
    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", splits)
    g = torch.Generator().manual_seed(1)
    p, heads, kv_heads, d, slots_n, length = 3, 4, 2, 16, 4, 40
    qkv = torch.randn(p, (heads + 2 * kv_heads) * d, generator=g)
    positions, slots = torch.tensor([5, 33, length - 1]), torch.tensor([2, 0, 3])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    k_cache, v_cache = torch.randn(slots_n, kv_heads, length, d, generator=g), torch.randn(slots_n, kv_heads, length, d, generator=g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q = decode_kernels.rope_write(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)
    q0, k0, v0 = qkv.view(p, heads + 2 * kv_heads, d).split((heads, kv_heads, kv_heads), dim=1)
    q_ref, k_rot = _rotate(q0, cos[:, None], sin[:, None]), _rotate(k0, cos[:, None], sin[:, None])
    for r in range(p):
        k_ref[slots[r], :, positions[r]] = k_rot[r]
        v_ref[slots[r], :, positions[r]] = v0[r]
    torch.testing.assert_close(q, q_ref)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    out = decode_kernels.attention(q, k_cache, v_cache, positions, slots, 1 / math.sqrt(d), free_position=length - 1)
    expected = _attend(q_ref, k_ref[slots], v_ref[slots], positions, 1 / math.sqrt(d))
    torch.testing.assert_close(out[:2], expected[:2], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out[2]).all()


@pytest.mark.parametrize(("dtype", "lanes", "splits"), [(torch.float32, 3, 2), (torch.float32, 3, 32),
                                                        (torch.float32, 1, 2), (torch.float16, 5, 2)])
def test_a_slots_rows_reading_it_once_attend_as_each_row_reading_it(monkeypatch, dtype, lanes, splits):
    """Grouped by slot (``lane_groups``), rows attend as they do reading their slot one by one and as the torch step's
    masked attention does: rows of one slot at other positions (more of them than a group holds, so a group is part
    empty), a row alone in its slot, free rows at and past the free position (one position read), 3 heads a kv head
    (lanes * 3 q rows: 3, 9 and 15, no power of two), more splits than a short row has positions."""
    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", splits)
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, length, free = 6, 2, 16, 70, 68
    slots = torch.tensor([1, 0, 1, 1, 2, 1, 0, 3, 1, 2, 0])
    positions = torch.tensor([10, 3, 67, 40, 7, 0, 20, 66, 55, free, free + 1])
    q = torch.randn(len(slots), heads, d, generator=g).to(dtype)
    k_cache = torch.randn(4, kv_heads, length, d, generator=g).to(dtype)
    v_cache = torch.randn(4, kv_heads, length, d, generator=g).to(dtype)
    scale = 1 / math.sqrt(d)
    groups = decode_kernels.lane_groups(slots, lanes, 4)

    per_row = decode_kernels.attention(q, k_cache, v_cache, positions, slots, scale, free_position=free)
    grouped = decode_kernels.attention(q, k_cache, v_cache, positions, slots, scale, free_position=free, groups=groups)
    read = torch.where(positions >= free, 0, positions)  # a free row reads position 0 only
    expected = _attend(q.float(), k_cache[slots].float(), v_cache[slots].float(), read, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(grouped.float(), per_row.float(), **tol)
    torch.testing.assert_close(grouped.float(), expected, **tol)


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_lane_groups_hold_every_row_once_with_its_slots_mates(lanes):
    """Each row is in one group, a group's rows share a slot and are at most ``lanes``, a slot's rows fill as few
    groups as they can; the table's shape depends on the row count only, and holds the most groups any step of
    that many rows makes (here: one slot holding all rows but one alone in each other slot)."""
    g = torch.Generator().manual_seed(4)
    slot_count, rows = 5, 13
    most = decode_kernels.max_lane_groups(rows, lanes, slot_count)
    for slots in [torch.randint(0, slot_count, (rows,), generator=g) for _ in range(4)] + [
            torch.tensor([0] * (rows - 4) + [1, 2, 3, 4]), torch.arange(rows) % slot_count]:
        table = decode_kernels.lane_groups(slots, lanes, slot_count)
        assert table.shape == (most, lanes) and table.dtype == torch.int32
        members = [[r for r in group if r >= 0] for group in table.tolist()]
        assert sorted(r for group in members for r in group) == list(range(rows))
        assert all(len({int(slots[r]) for r in group}) == 1 for group in members if group)
        counts = torch.bincount(slots, minlength=slot_count).tolist()
        assert sum(1 for group in members if group) == sum(-(-n // lanes) for n in counts)
    worst = torch.tensor([0] * (rows - slot_count + 1) + list(range(1, slot_count)))  # one row alone in each other slot
    assert sum(1 for group in decode_kernels.lane_groups(worst, lanes, slot_count).tolist() if max(group) >= 0) == most


def test_kernels_refuse_strided_row_vectors():
    positions = torch.arange(6)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        decode_kernels.attention(torch.zeros(3, 2, 4), torch.zeros(3, 1, 8, 4), torch.zeros(3, 1, 8, 4), positions,
                                 torch.arange(3), 1.0)


def test_attention_refuses_a_group_table_it_cannot_read():
    slots = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match="int32"):
        decode_kernels.attention(torch.zeros(3, 2, 4), torch.zeros(2, 1, 8, 4), torch.zeros(2, 1, 8, 4),
                                 torch.tensor([1, 2, 3]), slots, 1.0, groups=decode_kernels.lane_groups(slots, 2, 2).long())


def test_linear_retries_with_fewer_stages_when_shared_memory_runs_out(monkeypatch):
    """A block configuration too big for this GPU's shared memory is launched with fewer stages, and the count
    that fitted is kept for the next launches (so it never depends on the batch)."""
    launched: list[int] = []

    class TooBig:
        def __getitem__(self, grid):
            def launch(*args, num_stages, **kwargs):
                launched.append(num_stages)
                if num_stages > 2:
                    raise decode_kernels.triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")

            return launch

    monkeypatch.setattr(decode_kernels, "_linear_kernel", TooBig())
    monkeypatch.setattr(decode_kernels, "_fitting_stages", {})
    x, w = torch.zeros(1, 64), torch.zeros(64, 64)
    decode_kernels.linear(x, w, blocks=(32, 64, 4, 5))
    decode_kernels.linear(torch.zeros(4, 64), w, blocks=(32, 64, 4, 5))
    assert launched == [5, 4, 3, 2, 2]


@pytest.fixture(scope="module")
def setup(tiny_ar):
    t2i = tiny_ar.t2i
    return tiny_ar, SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p), build_prefix_cache(
        tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer)
    )


@pytest.mark.parametrize("fold_norms", [False, True])
@pytest.mark.parametrize("slots", [[0], [1], [3], [0, 2], [0, 1, 2, 3]])
def test_triton_step_matches_the_torch_step(setup, few_splits, slots, fold_norms):
    """Same drawn ids and the same hidden states up to float reordering, for one row alone (its inputs are
    strided views of the input table) and for rows with free rows between them."""
    tiny_ar, _, _ = setup
    torch_step = StaticDecoder(tiny_ar.model, 4, 64)
    triton_step = StaticDecoder(tiny_ar.model, 4, 64, kernels="triton", fold_norms=fold_norms)
    start = tiny_ar.config.gen_vocab_start_index
    for t in range(3):
        ids = [start + 3 + t + k for k in range(len(slots))]
        positions = [4 + t + 2 * k for k in range(len(slots))]
        draws = [((start, start + 60), SamplingParams(1.0, 50, 1.0), 7 + k, t) for k in range(len(slots))]
        a = torch_step.step(slots, ids, positions, draws)
        b = triton_step.step(slots, ids, positions, draws)
        assert a[0] == b[0]
        torch.testing.assert_close(b[1], a[1], rtol=1e-4, atol=1e-5)


def test_triton_step_with_more_slots_than_one_small_tile_matches_the_torch_step(setup, few_splits):
    """20 slots: the linears compute 32-row tiles; rows far apart (slot 17 beside slot 0) still match the torch
    step."""
    tiny_ar, _, _ = setup
    torch_step = StaticDecoder(tiny_ar.model, 20, 64)
    triton_step = StaticDecoder(tiny_ar.model, 20, 64, kernels="triton", fold_norms=True)
    assert triton_step.layers.tile == 32
    start = tiny_ar.config.gen_vocab_start_index
    slots = [0, 17]
    for t in range(2):
        ids = [start + 3 + t, start + 9 + t]
        positions = [4 + t, 7 + t]
        draws = [((start, start + 60), SamplingParams(1.0, 50, 1.0), 7 + k, t) for k in range(2)]
        a = torch_step.step(slots, ids, positions, draws)
        b = triton_step.step(slots, ids, positions, draws)
        assert a[0] == b[0]
        torch.testing.assert_close(b[1], a[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fold_norms", [False, True])
def test_triton_step_is_batch_invariant_to_the_bit(setup, few_splits, fold_norms):
    """Without full_length, row counts and lengths change with the batch-mates, yet a stream's tokens and states
    alone equal those among three others joining late at other sizes: no kernel's configuration or reduction
    order depends on the rows beside it."""
    tiny_ar, sampling, prefix = setup
    static = StaticDecoder(tiny_ar.model, slots=4, max_positions=300, kernels="triton", fold_norms=fold_norms)
    assert_alone_equals_among_late_joiners(tiny_ar, static, sampling, prefix)


def test_triton_step_decodes_a_guided_grid_as_the_eager_decoder_does(setup, few_splits):
    """AR guidance on the triton kernels: a guided image (its unconditional row in a slot of its own) beside an
    unguided one draws the eager decoder's tokens, and both slots of each come back."""
    tiny_ar, sampling, prefix = setup
    static = StaticDecoder(tiny_ar.model, slots=4, max_positions=300, kernels="triton")
    decoder = SlotDecoder(static)
    grid = grid_for_size(32, 32, 16)

    def stream(prompt, seed, guidance, reserve):
        ids = prompt_ids_for(tiny_ar.tokenizer, prompt, grid)
        return DecodeStream(tiny_ar.model, ids, grid, tiny_ar.t2i, sampling, seed, prefix=prefix, reserve=reserve,
                            guidance=guidance)

    expected = [generate_grid(tiny_ar.model, prompt_ids_for(tiny_ar.tokenizer, p, grid), grid, tiny_ar.t2i, sampling,
                              seed, prefix=prefix, guidance=g, pad_to=4).token_ids
                for p, seed, g in (("a cat", 5, 7.0), ("a dog", 6, 1.0))]
    streams = [stream("a cat", 5, 7.0, False), stream("a dog", 6, 1.0, False)]
    for s in streams:
        decoder.admit(s)
    decode_together(decoder, streams)
    assert [s.tokens for s in streams] == expected
    assert static.free_slots == 4


def test_triton_kernels_are_chosen_where_they_can_run(monkeypatch, caplog):
    """auto: torch off CUDA, with more slots than one launch holds (more than 16 with bf16 weights, more than 64
    with FP8), or when the probe launch fails; an explicit choice is kept. The probe runs at the slots' tile."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_decode_kernels("auto", cpu, 8, torch.float32) == "torch"
    assert resolve_decode_kernels("torch", cuda, 8, torch.bfloat16) == "torch"
    assert resolve_decode_kernels("triton", cpu, 8, torch.float32) == "triton"
    probed = []
    monkeypatch.setattr(decode_kernels, "available", True)
    monkeypatch.setattr(decode_kernels, "probe", lambda device, dtype, fp8, tile: probed.append((fp8, tile)) or None)
    assert resolve_decode_kernels("auto", cuda, 32, torch.bfloat16) == "torch"
    assert resolve_decode_kernels("auto", cuda, 65, torch.bfloat16, fp8=True) == "torch"
    assert probed == []
    assert resolve_decode_kernels("auto", cuda, 8, torch.bfloat16) == "triton"
    assert resolve_decode_kernels("auto", cuda, 64, torch.bfloat16, fp8=True) == "triton"
    assert probed == [(False, 16), (True, 64)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ar_service.model.static_decode"):
        assert resolve_decode_kernels("auto", cuda, 2, torch.bfloat16, fp8=True) == "triton"
        assert not caplog.records  # one image: the dot-free kernel
        assert resolve_decode_kernels("auto", cuda, 4, torch.bfloat16, fp8=True) == "triton"
    assert "4 slots with fp8 weights take the tensor-core fp8 kernel" in caplog.text
    monkeypatch.setattr(decode_kernels, "probe", lambda device, dtype, fp8, tile: RuntimeError("no bf16 dot on this GPU"))
    assert resolve_decode_kernels("auto", cuda, 8, torch.bfloat16) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_probe_runs_every_kernel(dtype):
    assert decode_kernels.probe(torch.device("cpu"), dtype) is None
    assert decode_kernels.probe_attention(torch.device("cpu"), dtype) is None


class Broken:
    """A kernel whose every launch raises ``message``, as one that cannot compile on a GPU does."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError(self.message)

        return launch


def test_the_probe_reports_a_kernel_that_fails(monkeypatch):
    monkeypatch.setattr(decode_kernels, "_attention_split_kernel", Broken("no bf16 dot on this GPU"))
    error = decode_kernels.probe(torch.device("cpu"), torch.float32)
    assert isinstance(error, RuntimeError) and "no bf16 dot" in str(error)


def test_the_attention_probe_reports_a_shared_read_that_fails(monkeypatch):
    """Steps of lanes on the torch kernels gather their slots unless this probe passes: a failing shared read of a
    slot's rows fails it too, not only the per-row read."""
    monkeypatch.setattr(decode_kernels, "_attention_lanes_kernel", Broken("out of shared memory"))
    error = decode_kernels.probe_attention(torch.device("cpu"), torch.float32)
    assert isinstance(error, RuntimeError) and "out of shared memory" in str(error)


def test_triton_kernels_on_a_cpu_without_the_interpreter_are_refused(setup, monkeypatch):
    tiny_ar, _, _ = setup
    monkeypatch.setattr(decode_kernels, "interpreting", False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticDecoder(tiny_ar.model, 2, 64, kernels="triton")
    with pytest.raises(ValueError, match="'triton' or 'torch'|'torch' or 'triton'"):
        StaticDecoder(tiny_ar.model, 2, 64, kernels="cutlass")
    with pytest.raises(ValueError, match="fold_norms needs kernels='triton'"):
        StaticDecoder(tiny_ar.model, 2, 64, fold_norms=True)


def assert_alone_equals_among_late_joiners(loaded, static: StaticDecoder, sampling, prefix) -> None:
    """A 48x32 stream's tokens and condition rows alone equal those among three others of 6, 4 and 3 tokens (with
    EOLs; the last listed joins first), one joining every second step: the target's 8 steps run beside 1, 2, 3, then
    4 rows, then fewer as the joiners finish. ``loaded``: a LoadedAR; ``static``: its 4-slot decoder."""
    decoder = SlotDecoder(static)
    grid = grid_for_size(48, 32, 16)
    ids = prompt_ids_for(loaded.tokenizer, "a cat", grid)
    alone = generate_grid(loaded.model, ids, grid, loaded.t2i, sampling, 5, prefix=prefix, decoder=decoder)

    def stream(prompt, size, seed, rows):
        g = grid_for_size(*size, 16)
        s = DecodeStream(loaded.model, prompt_ids_for(loaded.tokenizer, prompt, g), g, loaded.t2i, sampling, seed,
                         lambda r, h, t: rows.append(h), prefix=prefix, reserve=False)
        decoder.admit(s)
        return s

    rows: list[torch.Tensor] = []
    joiners = [stream(f"dog number {k}", size, 100 + k, []) for k, size in enumerate([(32, 16), (48, 16), (32, 32)])]
    target = stream("a cat", (48, 32), 5, rows)
    decode_together(decoder, [target], joiners, join_every=2)
    assert target.tokens == alone.token_ids
    assert torch.equal(torch.cat(rows), alone.image_condition)
    assert static.free_slots == 4
