"""Parallel AR decoding on the real tiny model (``ar_decoding``): the speculative mode decides several tokens per
forward and still draws the sequential grid (greedy and sampled, with AR guidance, top-k, top-p, temperature, alone
and batched); the row-parallel mode keeps the grid contract in fewer forwards; the engine takes the knobs, reports
the forwards and refuses what its decoder cannot do."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ar_service import events
from ar_service.conditions import prompt_ids_for
from ar_service.decoding import Decoding, RowParallel, Speculative
from ar_service.decoding.decoders import EagerDecoder, decode_together
from ar_service.decoding.stream import DecodeStream
from ar_service.generation import GenerationCancelled, generate_grid
from ar_service.model.loading import load_ar
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from protos.status import RequestRejected
from tests.ar_service.test_ar_batching import FakeRenderer, conditions, make_engine, wait_done

SPECULATIVE = [Decoding("speculative", 2), Decoding("speculative", 8), Decoding("speculative", 24)]
ROW_PARALLEL = [Decoding("row_parallel", 1), Decoding("row_parallel", 3)]
GRID = grid_for_size(128, 96, 16)  # 8 x 6 visual tokens: 6 rows of 9 and the look-ahead, 55 tokens


@pytest.fixture(scope="module")
def checkpoint(tiny_root):
    from servicekit.checkpoint import open_checkpoint

    return open_checkpoint(tiny_root)


def grid_of(tiny_ar, sampling, seed, decoding=None, guidance=1.0, grid=GRID, prompt="a cat on a mat", **kw):
    ids = prompt_ids_for(tiny_ar.tokenizer, prompt, grid)
    return generate_grid(tiny_ar.model, ids, grid, tiny_ar.t2i, sampling, seed, guidance=guidance, decoding=decoding,
                         **kw)


def assert_contract(tiny_ar, result, grid=GRID):
    t2i = tiny_ar.t2i
    assert len(result.token_ids) == grid.decode_tokens
    for i, token in enumerate(result.token_ids):
        if i % (grid.width + 1) == grid.width:
            assert token == t2i.eol_token_id
        else:
            assert t2i.visual_token_start_id <= token < t2i.visual_token_end_id
    assert result.image_condition.shape == (grid.condition_positions, tiny_ar.model.config.hidden_size)


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["unguided", "guided"])
@pytest.mark.parametrize("decoding", SPECULATIVE, ids=lambda d: f"window{d.window}")
def test_greedy_speculative_grid_and_condition_are_the_sequential_ones(tiny_ar, decoding, guidance):
    greedy = SamplingParams(temperature=0.0)
    sequential = grid_of(tiny_ar, greedy, 3, guidance=guidance)
    fast = grid_of(tiny_ar, greedy, 3, decoding, guidance=guidance)
    assert fast.token_ids == sequential.token_ids
    assert torch.equal(fast.image_condition, sequential.image_condition)
    assert torch.equal(fast.text_condition, sequential.text_condition)
    assert fast.forwards < sequential.forwards == GRID.decode_tokens - 1


@pytest.mark.parametrize(
    "sampling", [SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 5, 1.0), SamplingParams(1.3, 0, 0.8)],
    ids=["plain", "top-k", "top-p"],
)
def test_sampled_speculative_grid_is_the_sequential_one_for_every_seed(tiny_ar, sampling):
    """Every draw uses the noise of its own (seed, position), so a speculative run draws the very grid sequential
    decoding draws for the seed: the same distribution, seed by seed."""
    for seed in range(12):
        guidance = 1.0 if seed % 2 else 3.0
        sequential = grid_of(tiny_ar, sampling, seed, guidance=guidance)
        fast = grid_of(tiny_ar, sampling, seed, SPECULATIVE[seed % 3], guidance=guidance)
        assert fast.token_ids == sequential.token_ids, seed
        assert torch.equal(fast.image_condition, sequential.image_condition), seed


def _chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's two-sample statistic over the cells either sample saw, and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    cells = set(a) | set(b)
    stat = 0.0
    for cell in cells:
        x, y = a[cell], b[cell]
        stat += (math.sqrt(nb / na) * x - math.sqrt(na / nb) * y) ** 2 / (x + y)
    return stat, len(cells) - 1


def _chi_square_critical(dof: int) -> float:
    """The chi-square 0.999 quantile (Wilson-Hilferty), so a correct decoder fails 1 in 1,000 seed sets."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


class _BlindAcceptance(Speculative):
    """A wrong acceptance rule, for the distribution test to catch: every draft is kept as if the model drew it."""

    def take(self, lanes, hidden, tokens):
        for j, lane in enumerate(lanes):
            self.stream.ready_hidden[lane.step - 1] = hidden[j]
            self.stream.ready_tokens[lane.step] = lanes[j + 1].token if j + 1 < len(lanes) else tokens[j]


class _BlindDecoding(Decoding):
    def start(self, stream):
        return _BlindAcceptance(stream, self.window)


def test_speculative_token_distribution_matches_sequential_decoding_over_independent_seeds(tiny_root):
    """A distribution test with independent samples: the four visual tokens of a 2x2 grid (top-k 2: 16 outcomes) from
    400 speculative runs against 400 sequential runs of other seeds, on the tiny model with its generation head
    sharpened (random weights give nearly flat logits, where any rule looks right). The same test tells apart
    sequential decoding at temperature 0.6 (mass moved to the likelier tokens, as a greedy-leaning acceptance would)
    and an acceptance that keeps every draft."""
    model = load_ar(tiny_root)
    with torch.no_grad():
        model.model.gen_head.weight.mul_(12)
    grid = grid_for_size(32, 32, 16)
    ids = prompt_ids_for(model.tokenizer, "a red square", grid)

    def outcomes(seeds, decoding, temperature=1.0):
        # The seeds decode side by side, each its grid alone (the eager decoder is batch-invariant to the bit:
        # test_an_image_alone_equals_it_among_others_of_every_mode), in far fewer forwards.
        streams = [DecodeStream(model.model, ids, grid, model.t2i, SamplingParams(temperature, 2, 1.0), seed,
                                decoding=decoding) for seed in seeds]
        decode_together(EagerDecoder(model.model), streams)
        assert all(s.done for s in streams)
        return Counter(tuple(s.tokens[i] for i in (0, 1, 3, 4)) for s in streams)

    speculative = outcomes(range(400), Decoding("speculative", 6))
    sequential = outcomes(range(1000, 1400), None)
    stat, dof = _chi_square_two_sample(speculative, sequential)
    assert dof == 15  # every outcome seen: the draws spread over all 16
    assert stat < _chi_square_critical(dof), (stat, dof)
    for name, other in (("colder", outcomes(range(2000, 2400), None, temperature=0.6)),
                        ("blind", outcomes(range(3000, 3400), _BlindDecoding("speculative", 6)))):
        stat, dof = _chi_square_two_sample(speculative, other)
        assert stat > _chi_square_critical(dof), (name, stat, dof)


@pytest.mark.parametrize("decoding", ROW_PARALLEL, ids=lambda d: f"window{d.window}")
def test_row_parallel_keeps_the_grid_contract_in_fewer_forwards(tiny_ar, decoding):
    rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    result = grid_of(tiny_ar, SamplingParams(1.0, 0, 1.0), 9, decoding, guidance=3.0,
                     on_row=lambda r, h, t: rows.append((r, h, t)))
    assert_contract(tiny_ar, result)
    assert [r for r, _, _ in rows] == list(range(GRID.height))  # rows still reach the DiT in order
    width = GRID.width + 1
    for r, hidden, tokens in rows:
        assert torch.equal(hidden, result.image_condition[r * width : (r + 1) * width])
        assert tokens.tolist() == result.token_ids[r * width : (r + 1) * width]
    # a row starts once the row above has `window` tokens: (rows - 1) * window leads, then the last row's length
    assert result.forwards == RowParallel.forwards(GRID, decoding.window) == (GRID.height - 1) * decoding.window + 8
    assert result.forwards < (GRID.decode_tokens - 1) / 2


@pytest.mark.parametrize("size,window", [((128, 96), 2), ((64, 160), 3), ((96, 64), 9), ((48, 48), 1)])
def test_row_parallel_takes_the_forwards_its_formula_says(tiny_ar, size, window):
    """The count the GPU check compares against (bench.modes): (H - 1) * min(window, W) + W, guided or not."""
    grid = grid_for_size(*size, 16)
    for guidance in (1.0, 3.0):
        result = grid_of(tiny_ar, SamplingParams(1.0, 0, 1.0), 4, Decoding("row_parallel", window), guidance=guidance,
                         grid=grid)
        assert_contract(tiny_ar, result, grid)
        assert result.forwards == RowParallel.forwards(grid, window)


def test_row_parallel_is_seeded(tiny_ar):
    sampling = SamplingParams(1.0, 0, 1.0)
    first = grid_of(tiny_ar, sampling, 4, ROW_PARALLEL[1])
    assert grid_of(tiny_ar, sampling, 4, ROW_PARALLEL[1]).token_ids == first.token_ids
    assert grid_of(tiny_ar, sampling, 5, ROW_PARALLEL[1]).token_ids != first.token_ids


def test_an_image_alone_equals_it_among_others_of_every_mode(tiny_ar):
    """Batch invariance: a speculative and a row-parallel image decoded with 6 others (other modes, sizes, seeds,
    joining late) give their tokens and conditions alone, bit for bit."""
    t2i = tiny_ar.t2i
    sampling = SamplingParams(1.0, 0, 1.0)
    prefix = build_prefix_cache(tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer))

    def stream(prompt, grid, seed, decoding, rows, guidance=3.0):
        ids = prompt_ids_for(tiny_ar.tokenizer, prompt, grid)
        return DecodeStream(tiny_ar.model, ids, grid, t2i, sampling, seed, lambda r, h, t: rows.append(h),
                            prefix=prefix, guidance=guidance, decoding=decoding)

    modes = [None, *SPECULATIVE, *ROW_PARALLEL]
    for target_mode in (SPECULATIVE[1], ROW_PARALLEL[0]):
        alone_rows: list[torch.Tensor] = []
        alone = stream("a cat", GRID, 5, target_mode, alone_rows)
        decode_together(EagerDecoder(tiny_ar.model, pad_to=16), [alone])
        rows: list[torch.Tensor] = []
        target = stream("a cat", GRID, 5, target_mode, rows)
        joiners = [stream(f"dog number {k}", grid_for_size(64 + 16 * k, 64, 16), 100 + k, modes[k % len(modes)], [],
                          guidance=1.0 if k % 2 else 3.0) for k in range(6)]
        decode_together(EagerDecoder(tiny_ar.model, pad_to=16), [target], joiners, join_every=2)
        assert all(s.done for s in [target, *joiners])
        assert target.tokens == alone.tokens
        assert torch.equal(torch.cat(rows), torch.cat(alone_rows))


def test_cancellation_is_checked_before_every_forward(tiny_ar):
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(GenerationCancelled):
        grid_of(tiny_ar, SamplingParams(1.0, 0, 1.0), 1, SPECULATIVE[1], should_stop=should_stop)
    assert len(asked) == 4  # three forwards ran, the fourth was never started


def test_engine_serves_each_mode_reports_forwards_and_counts_them(tiny_ar, checkpoint):
    renderer = FakeRenderer()
    engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=4)
    base = dict(prompt="a lighthouse", width=128, height=96, seed=21, knobs={"num_inference_steps": 2, "top_k": 4})
    try:
        results = {}
        for mode, window in (("sequential", 0), ("speculative", 0), ("speculative", 5), ("row_parallel", 2)):
            knobs = {**base["knobs"], "ar_decoding": mode, "ar_decoding_window": window}
            plan = engine.plan(request_id=f"{mode}-{window}", **{**base, "knobs": knobs})
            assert plan.knobs["ar_decoding"] == mode
            got = wait_done(engine.submit(plan))
            assert isinstance(got[-1], events.JobDone)
            results[mode, window] = (got[-1].timings, conditions(renderer, f"{mode}-{window}"))
        timings, sequential = results["sequential", 0]
        assert timings["ar_forwards"] == timings["ar_tokens"] - 1 == GRID.decode_tokens - 1
        for key in (("speculative", 0), ("speculative", 5)):
            fast_timings, fast = results[key]
            assert fast_timings["ar_tokens"] == timings["ar_tokens"]
            assert fast_timings["ar_forwards"] < timings["ar_forwards"], key
            for index in sequential:  # the same conditions reach the DiT, bit for bit
                for (kind, offset, x), (kind2, offset2, y) in zip(sequential[index], fast[index], strict=True):
                    assert (kind, offset) == (kind2, offset2) and torch.equal(x, y)
        assert results["row_parallel", 2][0]["ar_forwards"] < timings["ar_forwards"] / 2
        registry = engine.metrics.registry
        assert registry.get_sample_value("ardit_ar_decode_forwards_total", {"decoding": "sequential"}) == 54
        spec_forwards = registry.get_sample_value("ardit_ar_decode_forwards_total", {"decoding": "speculative"})
        assert spec_forwards == sum(results[k][0]["ar_forwards"] for k in (("speculative", 0), ("speculative", 5)))
        assert registry.get_sample_value("ardit_ar_decoded_tokens_total", {"decoding": "speculative"}) == 2 * 54
        assert registry.get_sample_value("ardit_ar_tokens_per_forward_count", {"decoding": "row_parallel"}) == 1
    finally:
        engine.close()


def test_engine_refuses_what_it_cannot_decode(tiny_ar, checkpoint):
    engine = make_engine(tiny_ar, checkpoint)
    try:
        with pytest.raises(RequestRejected) as refused:
            engine.plan(prompt="p", width=64, height=64, knobs={"ar_decoding": "jacobi"})
        assert refused.value.param == "ar_decoding" and "'speculative'" in str(refused.value)
        with pytest.raises(RequestRejected) as refused:
            engine.plan(prompt="p", width=64, height=64, knobs={"ar_decoding_window": 4})
        assert refused.value.param == "ar_decoding_window"
        with pytest.raises(RequestRejected) as refused:
            engine.plan(prompt="p", width=64, height=64, knobs={"ar_decoding": "speculative", "ar_decoding_window": 65})
        assert refused.value.param == "ar_decoding_window"
    finally:
        engine.close()
    fast = make_engine(tiny_ar, checkpoint, fast_decode=True, max_batch_size=1)
    try:  # the fixed slots serve every mode
        for mode in ("sequential", "speculative", "row_parallel"):
            assert fast.plan(prompt="p", width=64, height=64, knobs={"ar_decoding": mode}).decoding.mode == mode
    finally:
        fast.close()
    from ar_service.decoding.decoders import SlotDecoder
    from ar_service.model.static_decode import StaticDecoder

    one_lane = SlotDecoder(StaticDecoder(tiny_ar.model, slots=2, max_positions=300))  # rows of one slot: never
    engine = make_engine(tiny_ar, checkpoint, decoder=one_lane, max_batch_size=1)
    try:
        for mode in ("row_parallel", "speculative"):
            with pytest.raises(RequestRejected) as refused:
                engine.plan(prompt="p", width=64, height=64, knobs={"ar_decoding": mode})
            assert refused.value.param == "ar_decoding"
            assert "one token per image and forward" in str(refused.value) and "accepted here: 'sequential'" in str(
                refused.value)
    finally:
        engine.close()


@pytest.fixture
def few_splits(monkeypatch):
    """Two attention splits: Triton's interpreter runs programs one by one on the CPU."""
    from ar_service.model import decode_kernels

    monkeypatch.setattr(decode_kernels, "ATTENTION_SPLITS", 2)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_slot_decoder_decodes_speculative_lanes_to_the_sequential_grid(tiny_ar, kernels, few_splits):
    """Lanes in the fixed slots (rows of one slot in one step): the sequential grid, guided and not, alone and beside
    a sequential stream, in fewer steps; the lanes are cut to the decoder's rows (6 here, for 2 guided streams).
    Triton's kernels run interpreted on the CPU, so they get a smaller grid."""
    from ar_service.decoding.decoders import SlotDecoder
    from ar_service.model import decode_kernels
    from ar_service.model.static_decode import StaticDecoder

    if kernels == "triton" and not decode_kernels.available:
        pytest.skip("triton is not installed (no wheel for this platform)")
    grid = GRID if kernels == "torch" else grid_for_size(48, 32, 16)  # 3 x 2: a first window of 8 lanes, cut to 6
    sampling = SamplingParams(1.0, 4, 1.0)
    static = StaticDecoder(tiny_ar.model, slots=6, max_positions=300, kernels=kernels, shared_slots=True,
                           full_length=kernels == "torch")
    decoder = SlotDecoder(static)
    assert decoder.decodes(Decoding("speculative", 8)) and decoder.decodes(Decoding("row_parallel", 2))
    for guidance in (1.0, 3.0):
        sequential = grid_of(tiny_ar, sampling, 11, guidance=guidance, grid=grid)
        fast = grid_of(tiny_ar, sampling, 11, Decoding("speculative", 8), guidance=guidance, decoder=decoder,
                       grid=grid)
        assert fast.token_ids == sequential.token_ids
        assert torch.allclose(fast.image_condition, sequential.image_condition, atol=1e-4)
        assert fast.forwards < sequential.forwards
    assert static.free_slots == 6

    def stream(seed, decoding, guidance):
        ids = prompt_ids_for(tiny_ar.tokenizer, "a cat on a mat", grid)
        s = DecodeStream(tiny_ar.model, ids, grid, tiny_ar.t2i, sampling, seed, reserve=False, guidance=guidance,
                         decoding=decoding)
        decoder.admit(s)
        return s

    pair = [stream(11, Decoding("speculative", 8), 3.0), stream(12, None, 3.0)]
    decode_together(decoder, pair)
    assert pair[0].tokens == grid_of(tiny_ar, sampling, 11, guidance=3.0, grid=grid).token_ids
    assert pair[1].tokens == grid_of(tiny_ar, sampling, 12, guidance=3.0, grid=grid).token_ids
    assert static.free_slots == 6
    plain = SlotDecoder(StaticDecoder(tiny_ar.model, slots=2, max_positions=300))
    assert not plain.decodes(Decoding("speculative", 8))
    with pytest.raises(ValueError):
        plain.admit(DecodeStream(tiny_ar.model, prompt_ids_for(tiny_ar.tokenizer, "x", grid), grid, tiny_ar.t2i,
                                 sampling, 1, reserve=False, decoding=Decoding("speculative", 4)))


@pytest.mark.parametrize("way", ["gather", "triton-slots"])
def test_the_service_setting_chooses_how_steps_of_lanes_read_their_slots(tiny_ar, checkpoint, way, few_splits):
    """ar_service's ``decode_lane_attention`` reaches the fast decoder (its start log's words); a way it does not
    know, or a direct read under deterministic decoding, is refused when the settings load, naming what it takes."""
    from pydantic import ValidationError

    from ar_service.model import decode_kernels
    from ar_service.model.static_decode import GROUPED_LANE_ROWS
    from ar_service.settings import ARSettings

    if way != "gather" and not decode_kernels.available:
        pytest.skip("triton is not installed (no wheel for this platform)")
    assert ARSettings(decode_lane_attention=way).decode_lane_attention == way
    engine = make_engine(tiny_ar, checkpoint, fast_decode=True, max_batch_size=1, decode_lane_attention=way)
    try:
        assert engine.decoder.static.lane_read == {
            "gather": "slots gathered",
            "triton-slots": f"slots read in place, once for a slot's rows in steps of {GROUPED_LANE_ROWS} rows or more",
        }[way]
    finally:
        engine.close()
    with pytest.raises(ValidationError, match="'auto', 'gather', 'triton' or 'triton-slots'"):
        ARSettings(decode_lane_attention="paged")
    with pytest.raises(ValidationError, match="triton and triton-slots need deterministic off"):
        ARSettings(decode_lane_attention="triton", deterministic=True)
    assert ARSettings(decode_lane_attention="gather", deterministic=True).deterministic


@pytest.mark.parametrize(("kernels", "lane_attention"),
                         [("torch", "gather"), ("torch", "triton"), ("torch", "triton-slots"), ("triton", "auto")])
def test_the_slot_decoder_decodes_row_parallel_to_the_eager_grid(tiny_ar, kernels, lane_attention, few_splits,
                                                                 monkeypatch):
    """Row-parallel lanes in the fixed slots (RoPE at the raster position, K/V at the cache index in generation
    order) draw the eager decoder's grid, guided and not, in the same forwards; with fewer rows than a step's lanes
    they run in several passes and still draw it; with few slots but wide steps of lanes (``lane_rows``) in one
    pass a forward; beside a sequential and a speculative stream (batch-mates) too. The torch kernels' steps of
    lanes gather each row's slot or have the triton attention read it in place, per row or per slot
    (``lane_attention``).

    Triton's interpreter runs every program one by one on the CPU, so its runs are kept small: a smaller grid,
    smaller batch-mates beside the row-parallel stream, and no decoder with as many slots as rows (its steps of lanes
    are the wide-lanes decoder's: the same passes, row tile and slot numbers)."""
    from ar_service.decoding.decoders import SlotDecoder
    from ar_service.model import decode_kernels, static_decode
    from ar_service.model.static_decode import StaticDecoder

    interpreted = kernels == "triton" or lane_attention != "gather"
    if interpreted and not decode_kernels.available:
        pytest.skip("triton is not installed (no wheel for this platform)")
    monkeypatch.setattr(static_decode, "GROUPED_LANE_ROWS", 1)  # every step of lanes grouped: the interpreter's are narrow
    # Triton's kernels run interpreted on the CPU, so they get a smaller grid: 3 x 4 at window 1, whose guided steps
    # of lanes still overflow 6 slots (4 x 3 at window 2 never does). The batch-mates take 3 x 2 (row-parallel) and
    # 2 x 2, whose steps together still overflow them.
    grid = grid_for_size(48, 64, 16) if interpreted else GRID
    small, smaller = (grid_for_size(48, 32, 16), grid_for_size(32, 32, 16)) if interpreted else (grid, grid)
    sampling = SamplingParams(1.0, 4, 1.0)
    decoding = Decoding("row_parallel", 1 if interpreted else 2)

    def slot_decoder(slots, lane_rows=None):
        # full_length (every step at the slots' rows) keeps the torch kernels' rounding off the row count; wider
        # steps of lanes, and lanes read in place, cannot have it
        full_length = kernels == "torch" and lane_rows is None and lane_attention == "gather"
        return SlotDecoder(StaticDecoder(tiny_ar.model, slots=slots, max_positions=300, kernels=kernels,
                                         shared_slots=True, full_length=full_length,
                                         lane_rows=lane_rows, lane_attention=lane_attention))

    def count_passes(decoder):
        """The rows of each pass the decoder runs, plain steps and steps of lanes alike."""
        passes = []
        step, step_lanes = decoder.static.step, decoder.static.step_lanes
        decoder.static.step = lambda *args, **kw: passes.append(len(args[0])) or step(*args, **kw)
        decoder.static.step_lanes = lambda *args: passes.append(len(args[0])) or step_lanes(*args)
        return passes

    narrow, wide_lanes = slot_decoder(6), slot_decoder(6, lane_rows=16)
    decoders = (narrow, wide_lanes) if interpreted else (slot_decoder(16), narrow, wide_lanes)
    passes, wide_passes = count_passes(narrow), count_passes(wide_lanes)
    for guidance in (1.0, 3.0):
        eager = grid_of(tiny_ar, sampling, 5, decoding, guidance=guidance, grid=grid)
        sequential = grid_of(tiny_ar, sampling, 5, guidance=guidance, grid=grid)
        # row-parallel conditions on less of the grid: the test can tell it from sequential decoding
        assert not torch.allclose(eager.image_condition, sequential.image_condition, atol=1e-2)
        passes.clear()  # what is left after the loop: the guided decode's passes
        wide_passes.clear()
        for decoder in decoders:
            fast = grid_of(tiny_ar, sampling, 5, decoding, guidance=guidance, decoder=decoder, grid=grid)
            assert fast.token_ids == eager.token_ids
            assert torch.allclose(fast.image_condition, eager.image_condition, atol=1e-4)
            assert fast.forwards == eager.forwards < sequential.forwards
            assert decoder.static.free_slots == decoder.static.slots
    assert max(passes) <= 6 and len(passes) > eager.forwards  # some forwards of the guided decode took two passes
    assert max(wide_passes) <= 16
    if grid == GRID:  # the larger grid has steps of more lanes than 6 slots hold: these go in fewer passes
        assert max(wide_passes) > 6 and len(wide_passes) < len(passes)

    def stream(decoder, seed, mode, grid):
        ids = prompt_ids_for(tiny_ar.tokenizer, "a cat on a mat", grid)
        s = DecodeStream(tiny_ar.model, ids, grid, tiny_ar.t2i, sampling, seed, reserve=False, guidance=3.0,
                         decoding=mode)
        decoder.admit(s)
        return s

    for decoder in decoders:
        mates = [stream(decoder, 7, None, smaller), stream(decoder, 5, decoding, small),
                 stream(decoder, 8, Decoding("speculative", 4), smaller)]
        decode_together(decoder, mates)
        assert mates[1].tokens == grid_of(tiny_ar, sampling, 5, decoding, guidance=3.0, grid=small).token_ids
        assert mates[0].tokens == grid_of(tiny_ar, sampling, 7, guidance=3.0, grid=smaller).token_ids
        assert mates[2].tokens == grid_of(tiny_ar, sampling, 8, guidance=3.0, grid=smaller).token_ids
        assert decoder.static.free_slots == decoder.static.slots
