"""The fast decode step (fixed slots, in-place K/V) against the eager one, on the tiny model on CPU.

On CUDA the same step is captured in graphs; the numbers it replays are those of this eager run of it.
"""

from __future__ import annotations

import time

import pytest
import torch

from ar_service import events
from ar_service.conditions import prompt_ids_for
from ar_service.decoding.decoders import ROWS_PER_IMAGE, EagerDecoder, SlotDecoder, decode_together
from ar_service.decoding.stream import DecodeStream
from ar_service.generation import generate_grid
from ar_service.model import decode_kernels
from ar_service.model.static_decode import StaticDecoder
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from servicekit.checkpoint import open_checkpoint
from tests.ar_service.test_ar_batching import FakeRenderer, make_engine, wait_done


@pytest.fixture(scope="module")
def setup(tiny_ar):
    t2i = tiny_ar.t2i
    return tiny_ar, SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p), build_prefix_cache(
        tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer)
    )


def _grid(tiny_ar, sampling, prefix, prompt, size, seed, decoder):
    grid = grid_for_size(*size, 16)
    ids = prompt_ids_for(tiny_ar.tokenizer, prompt, grid)
    return generate_grid(tiny_ar.model, ids, grid, tiny_ar.t2i, sampling, seed, prefix=prefix, decoder=decoder)


@pytest.mark.parametrize("full_length", [False, True])
def test_fast_decode_matches_the_eager_decode(setup, full_length):
    """Same tokens, same condition states up to float reordering, for a grid that crosses several length buckets."""
    tiny_ar, sampling, prefix = setup
    static = StaticDecoder(tiny_ar.model, slots=4, max_positions=1200, full_length=full_length)
    eager = _grid(tiny_ar, sampling, prefix, "a lighthouse", (256, 256), 7, EagerDecoder(tiny_ar.model, 4))
    fast = _grid(tiny_ar, sampling, prefix, "a lighthouse", (256, 256), 7, SlotDecoder(static))
    assert len(eager.token_ids) > 256  # more than one bucket of positions
    assert fast.token_ids == eager.token_ids
    torch.testing.assert_close(fast.image_condition, eager.image_condition, rtol=1e-4, atol=1e-5)
    assert static.free_slots == 4  # the slot came back


def test_full_length_fast_decode_is_batch_invariant_to_the_bit(setup):
    """With every step over the whole cache, a stream's tokens and states alone equal those among three others
    that join late, at other sizes and positions."""
    tiny_ar, sampling, prefix = setup
    static = StaticDecoder(tiny_ar.model, slots=4, max_positions=700, full_length=True)
    decoder = SlotDecoder(static)
    alone = _grid(tiny_ar, sampling, prefix, "a cat", (128, 128), 5, decoder)

    def stream(prompt, size, seed, rows):
        g = grid_for_size(*size, 16)
        ids = prompt_ids_for(tiny_ar.tokenizer, prompt, g)
        s = DecodeStream(tiny_ar.model, ids, g, tiny_ar.t2i, sampling, seed, lambda r, h, t: rows.append(h),
                         prefix=prefix, reserve=False)
        decoder.admit(s)
        return s

    rows: list[torch.Tensor] = []
    target = stream("a cat", (128, 128), 5, rows)
    joiners = [stream(f"dog number {k}", (64 + 16 * k, 96), 100 + k, []) for k in range(3)]
    decode_together(decoder, [target], joiners, join_every=5)
    assert target.tokens == alone.token_ids
    assert torch.equal(torch.cat(rows), alone.image_condition)
    assert static.free_slots == 4


def test_static_decoder_refuses_what_it_cannot_hold(setup):
    tiny_ar, _, _ = setup
    static = StaticDecoder(tiny_ar.model, slots=1, max_positions=64)
    start = tiny_ar.config.gen_vocab_start_index
    draw = ((start, start), SamplingParams(), 0, 0)
    with pytest.raises(ValueError, match="generation-vocabulary"):
        static.step([0], [5], [3], [draw])
    with pytest.raises(ValueError, match="beyond the decode cache"):
        static.step([0], [start], [63], [draw])
    with pytest.raises(ValueError, match="cache index 63 is beyond the decode cache"):
        static.step([0], [start], [3], [draw], indexes=[63])
    with pytest.raises(ValueError, match="one draw"):
        static.step([0], [start], [3], [])
    with pytest.raises(ValueError, match="not in use"):
        static.release(0)


@pytest.mark.parametrize("lookahead", [False, True])
def test_engine_with_fast_decode_gives_the_eager_engine_tokens_and_frees_slots(tiny_ar, tiny_root, lookahead):
    """Four requests, one cancelled mid-decode: the others' token grids equal the eager engine's, and every slot
    is free again afterwards (also with steps launched ahead)."""
    checkpoint = open_checkpoint(tiny_root)
    specs = [dict(prompt=f"scene {k}", width=64 + 16 * k, height=64, seed=3 * k) for k in range(4)]
    results = {}
    for fast in (False, True):
        engine = make_engine(tiny_ar, checkpoint, FakeRenderer(), max_batch_size=4, fast_decode=fast,
                             decode_lookahead=lookahead)
        try:
            jobs = [engine.submit(engine.plan(request_id=f"r{k}", **spec), mode="tokens") for k, spec in enumerate(specs)]
            victim = engine.submit(engine.plan(request_id="victim", prompt="cancel me", width=256, height=256), mode="tokens")
            got = [wait_done(job) for job in jobs]
            victim.cancel()
            results[fast] = [[e.token_ids for e in events_ if isinstance(e, events.TokenRow)] for events_ in got]
            assert all(isinstance(events_[-1], events.JobDone) for events_ in got)
            deadline = time.monotonic() + 30
            while engine.status().running and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.status().running == 0
            if fast:  # two slots per image (a guided image's unconditional row takes the second)
                assert engine.decoder.static.free_slots == ROWS_PER_IMAGE * 4
        finally:
            engine.close()
    assert results[True] == results[False]


def test_a_fresh_decoder_steps_its_free_rows_safely(setup):
    """Graphs are captured at start-up before any stream holds a slot: the free rows' inputs must be valid ids
    at the scratch position, drawing a forced id."""
    tiny_ar, _, _ = setup
    static = StaticDecoder(tiny_ar.model, slots=2, max_positions=300)
    drawn, hidden = static._forward(256, 2)
    assert drawn.tolist() == [tiny_ar.config.gen_vocab_start_index] * 2
    assert torch.isfinite(hidden).all()
    assert static.warm_up(300) == 0  # no CUDA graphs on the CPU


def test_length_buckets_cover_every_length_with_at_most_a_quarter_masked():
    from ar_service.model.static_decode import MIN_BUCKET, bucket_for

    previous = 0
    for n in range(1, 20_000, 7):
        b = bucket_for(n)
        assert b >= n and b >= previous  # covers, and never shrinks as a stream grows
        assert b <= max(MIN_BUCKET, 1.25 * n + 64)
        previous = b
    assert len({bucket_for(n) for n in range(1, 17_611)}) < 40  # few graphs per row count


@pytest.mark.parametrize("shared_slots", [False, True], ids=["slots", "lanes"])
def test_warm_up_captures_every_shape_a_request_can_step_in(setup, shared_slots):
    """Every (bucket, rows, gather) that step() and, with shared slots, step_lanes() pick for streams up to the
    warm-up length is among the captured graphs, so no request pays for a capture; steps of lanes up to their own
    width (``lane_rows``, beyond the slots here)."""
    tiny_ar, _, _ = setup
    for full_length in (False, True):
        wide = 24 if shared_slots and not full_length else 8  # full_length: every step at the slots' rows
        static = StaticDecoder(tiny_ar.model, slots=8, max_positions=5000, full_length=full_length,
                               shared_slots=shared_slots, lane_rows=wide)
        keys = set(static.graph_keys(4500))
        steps = [(slots, False) for slots in ([0], [1], [0, 2], [3], [0, 1, 2, 3, 4], [7], [5, 6])]
        if shared_slots:  # a step of lanes places its rows in the order given: 0 .. n - 1
            steps += [(list(range(n)), True) for n in (1, 2, 3, 8, 9, 17, 24) if n <= wide]
        for slots, lanes in steps:
            for position in (0, 255, 256, 257, 1056, 2049, 4499):
                assert static.shape_for(slots, [position] * len(slots), lanes) in keys
        assert any(gather for _, _, gather in keys) == shared_slots
        assert max(rows for _, rows, _ in keys) == wide


def test_steps_of_lanes_reading_their_slots_in_place_have_no_length_buckets(setup, monkeypatch):
    """With ``lane_attention`` "triton" (the CUDA default where triton imports) a step of lanes on the torch kernels
    reads each row's slot in place over its own length, and with "triton-slots" each slot once for its rows in the
    step: one graph per row count instead of one per row count and length bucket, and the same tokens and states as
    gathering each row's slot (the kernel runs interpreted here).
    "triton-slots" groups only steps of ``GROUPED_LANE_ROWS`` rows or more (3 here): a narrower step reads once a row,
    to the bit as "triton" does.
    On the CPU auto gathers; so does ``full_length`` (deterministic decoding), where a step of lanes must attend as
    the plain steps do; an unknown way is refused."""
    from ar_service.model import static_decode

    if not decode_kernels.available:
        pytest.skip("triton is not installed (no wheel for this platform)")
    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", 2)  # the interpreter runs programs one by one
    monkeypatch.setattr(static_decode, "GROUPED_LANE_ROWS", 3)  # the interpreter's steps are narrow
    tiny_ar, _, _ = setup
    built = {way: StaticDecoder(tiny_ar.model, slots=2, max_positions=700, shared_slots=True, lane_rows=4,
                                lane_attention=way) for way in ("gather", "triton", "triton-slots")}
    assert StaticDecoder(tiny_ar.model, slots=2, max_positions=64).lane_attention == "gather"
    with pytest.raises(ValueError, match="lane_attention must be 'auto', 'gather', 'triton' or 'triton-slots'"):
        StaticDecoder(tiny_ar.model, slots=2, max_positions=64, lane_attention="paged")
    with pytest.raises(ValueError, match="full_length steps of lanes attend as every other step does"):
        StaticDecoder(tiny_ar.model, slots=2, max_positions=64, full_length=True, lane_attention="triton")
    assert [built[way].lane_read for way in built] == [
        "slots gathered", "slots read in place, once a row",
        "slots read in place, once for a slot's rows in steps of 3 rows or more"]
    lanes = {way: [key for key in static.graph_keys(650) if key[2]] for way, static in built.items()}
    for way in ("triton", "triton-slots"):
        assert sorted(rows for _, rows, _ in lanes[way]) == [1, 2, 4]
        assert {bucket for bucket, _, _ in lanes[way]} == {700}
    assert len(lanes["gather"]) == 3 * len({bucket for bucket, _, _ in lanes["gather"]}) > 3
    assert built["triton"].shape_for([0, 1, 2], [5, 300, 6], lanes=True) == (700, 4, True)
    assert built["gather"].shape_for([0, 1, 2], [5, 300, 6], lanes=True) == (320, 4, True)
    # Two streams' caches filled by plain steps, then steps of lanes: two rows of slot 0 and one of slot 1
    start = tiny_ar.config.gen_vocab_start_index
    draw = ((start, start + 8), SamplingParams(), 0, 0)
    results, narrow, grouped_narrow = {}, {}, {}
    for way, static in built.items():
        for position in range(300):
            static.step([0, 1], [start + position % 7, start + position % 5], [position, position], [draw, draw])
        # a step of two lanes first, under the grouping's width
        narrow[way] = static.step_lanes([0, 1], [start + 4, start + 5], [300, 300], [draw] * 2)
        grouped_narrow[way] = getattr(static.layers, "groups", None) is not None
        results[way] = [static.step_lanes([0, 0, 1], [start + 1, start + 2, start + 3], [301 + n, 302 + n, 301 + n],
                                          [draw] * 3) for n in (0, 2)]
    for way in ("triton", "triton-slots"):
        for (tokens, hidden), (tokens_gathered, hidden_gathered) in zip(results[way], results["gather"], strict=True):
            assert tokens == tokens_gathered
            torch.testing.assert_close(hidden, hidden_gathered, rtol=1e-4, atol=1e-5)
    # under the grouping's width "triton-slots" read once a row, as "triton" does, to the bit; at it, once a slot
    assert narrow["triton-slots"][0] == narrow["triton"][0]
    assert torch.equal(narrow["triton-slots"][1], narrow["triton"][1])
    assert not grouped_narrow["triton-slots"] and built["triton-slots"].layers.groups is not None


def test_steps_of_lanes_are_as_wide_as_lane_rows_and_no_wider(setup):
    """A decoder of few slots runs steps of lanes up to its ``lane_rows`` (auto: 64 rows with the torch kernels,
    the slots with the triton ones, whose row tile follows it, and when deterministic), refuses wider ones, and
    refuses a width it cannot take; so does ar_service's settings."""
    from ar_service.model.static_decode import DEFAULT_LANE_ROWS, lane_rows_for
    from ar_service.settings import ARSettings

    tiny_ar, _, _ = setup
    assert lane_rows_for(0, 4, "torch") == DEFAULT_LANE_ROWS == 64 and lane_rows_for(0, 128, "torch") == 128
    assert lane_rows_for(0, 4, "triton") == 4 and lane_rows_for(32, 4, "triton") == 32
    assert lane_rows_for(0, 4, "torch", full_length=True) == 4
    assert lane_rows_for(8, 16, "torch") == 16  # never fewer than the slots
    static = StaticDecoder(tiny_ar.model, slots=2, max_positions=64, shared_slots=True, lane_rows=6)
    start = tiny_ar.config.gen_vocab_start_index
    draw = ((start, start + 3), SamplingParams(), 0, 0)
    tokens, hidden = static.step_lanes([0] * 6, [start] * 6, list(range(6)), [draw] * 6)
    assert len(tokens) == 6 and hidden.shape[0] == 6 and torch.isfinite(hidden).all()
    with pytest.raises(ValueError, match="at most 6 rows; got 7"):
        static.step_lanes([0] * 7, [start] * 7, list(range(7)), [draw] * 7)
    with pytest.raises(ValueError, match="at least the slots"):
        StaticDecoder(tiny_ar.model, slots=4, max_positions=64, shared_slots=True, lane_rows=2)
    with pytest.raises(ValueError, match="needs shared_slots"):
        StaticDecoder(tiny_ar.model, slots=2, max_positions=64, lane_rows=4)
    with pytest.raises(ValueError, match="full_length runs every step at the slots' rows"):
        StaticDecoder(tiny_ar.model, slots=2, max_positions=64, shared_slots=True, lane_rows=4, full_length=True)
    assert ARSettings(decode_lane_rows=128).decode_lane_rows == 128
    with pytest.raises(ValueError, match="decode_lane_rows needs deterministic off"):
        ARSettings(decode_lane_rows=128, deterministic=True)


def test_steps_launched_ahead_change_nothing(setup):
    """One grid decoded with each next step launched before it is asked for equals the grid decoded without, bit
    for bit, and the launched steps were the ones taken."""
    tiny_ar, sampling, prefix = setup
    plain = StaticDecoder(tiny_ar.model, slots=2, max_positions=700)
    ahead = StaticDecoder(tiny_ar.model, slots=2, max_positions=700)
    ahead.lookahead = True
    a = _grid(tiny_ar, sampling, prefix, "a lighthouse", (128, 128), 9, SlotDecoder(plain))
    b = _grid(tiny_ar, sampling, prefix, "a lighthouse", (128, 128), 9, SlotDecoder(ahead))
    assert a.token_ids == b.token_ids
    assert torch.equal(a.image_condition, b.image_condition)
    assert ahead.ahead_taken == len(a.token_ids) - 2 and ahead.ahead_wasted == 0


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_decode_steps_outside_inference_mode_leave_the_cache_out_of_autograd(setup, kernels):
    """The graph captures at start step outside the engine's inference mode, and the model's weights require grad.
    Were those steps recorded, every K/V write would chain that step's saved activations to the cache, which lives
    as long as the decoder: memory growing with each captured graph (tens of GiB at 32 images on the GPU)."""
    if kernels == "triton" and not decode_kernels.available:
        pytest.skip("triton is not installed (no wheel for this platform)")
    tiny_ar, _, _ = setup
    assert any(p.requires_grad for p in tiny_ar.model.parameters())  # what makes the guard necessary
    static = StaticDecoder(tiny_ar.model, slots=2, max_positions=300, kernels=kernels)
    start = tiny_ar.config.gen_vocab_start_index
    draw = ((start, start + 8), SamplingParams(), 0, 0)
    for position in range(3):
        _, hidden = static.step([0, 1], [start, start + 1], [position, position], [draw, draw])
        assert not hidden.requires_grad
    assert static.k.grad_fn is None and static.v.grad_fn is None
    assert not static.k.requires_grad and not static.v.requires_grad


def test_a_compiled_decoder_leaves_dynamo_room_for_every_row_count(setup, monkeypatch):
    """The layer bodies compile once per row count: a decoder of 4 slots with steps of lanes up to 256 rows has nine
    (1 to 256), one more than dynamo's default recompile limit, past which its widest steps would run uncompiled."""
    tiny_ar, _, _ = setup
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    static = StaticDecoder(tiny_ar.model, slots=4, max_positions=64, shared_slots=True, lane_rows=256, compile=True)
    assert len(set(static.row_counts(4)) | set(static.row_counts(256))) == 9
    assert torch._dynamo.config.recompile_limit >= 9
    StaticDecoder(tiny_ar.model, slots=4, max_positions=64, compile=True)
    assert torch._dynamo.config.recompile_limit >= 9  # never lowered
