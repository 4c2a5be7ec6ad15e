"""AR classifier-free guidance on the tiny model: its semantics pinned against hand-computed logits, then the
decode paths (eager, fixed slots) and the engine (seed + i, batch invariance, the knob).

Semantics (released MammothModa2 ``generate_t2i``): the unconditional row sees only the last 10 prompt tokens, at
positions 0..9, then the generated tokens; the float32 logits are mixed ``uncond + (cond - uncond) * scale`` before
the allowed range, temperature, top-k and top-p; both rows are fed the token drawn.
"""

from __future__ import annotations

import json

import pytest
import torch

from ar_service import events
from ar_service.conditions import prompt_ids_for
from ar_service.decoding.decoders import EagerDecoder, SlotDecoder, decode_together
from ar_service.decoding.stream import UNCOND_PROMPT_TOKENS, DecodeStream
from ar_service.generation import generate_grid
from ar_service.model.static_decode import StaticDecoder
from ar_service.model.t2i_config import RELEASED_AR_CFG_SCALE, T2IGenerationConfig
from ar_service.prefill import build_prefix_cache, system_prefix_ids
from ar_service.prompt import allowed_token_range, grid_for_size
from ar_service.sampling import RowSampling, SamplingParams, guided, sample_rows
from protos.status import RequestRejected
from servicekit.checkpoint import open_checkpoint
from tests.ar_service.test_ar_batching import FakeRenderer, make_engine, wait_done

GRID = grid_for_size(64, 64, 16)  # 4x4: 21 tokens
GREEDY = SamplingParams(0.0, 2048, 1.0)
SCALE = 7.0


@pytest.fixture(scope="module")
def prefix(tiny_ar):
    return build_prefix_cache(tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer))


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits of the last position of ``ids`` run from position 0, no cache: [V]."""
    logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], None, num_logits=1)
    return logits[0, -1]


def reference_guided_grid(tiny_ar, prompt_ids: list[int], scale: float) -> list[int]:
    """Greedy guided decode, by hand: at each step the conditional row is the whole sequence, the unconditional row
    the last 10 prompt tokens and what was generated, both recomputed from scratch; mix, then the grid's range."""
    tokens: list[int] = []
    for step in range(GRID.decode_tokens):
        cond = last_logits(tiny_ar.model, prompt_ids + tokens)
        uncond = last_logits(tiny_ar.model, prompt_ids[-UNCOND_PROMPT_TOKENS:] + tokens)
        mixed = uncond + (cond - uncond) * scale
        lo, hi = allowed_token_range(step, GRID, tiny_ar.t2i)
        tokens.append(lo + int(mixed[lo : hi + 1].argmax()))
    return tokens


def test_guided_greedy_grid_equals_the_hand_computed_one(tiny_ar, prefix):
    ids = prompt_ids_for(tiny_ar.tokenizer, "a red apple", GRID)
    expected = reference_guided_grid(tiny_ar, ids, SCALE)
    got = generate_grid(tiny_ar.model, ids, GRID, tiny_ar.t2i, GREEDY, 0, prefix=prefix, guidance=SCALE)
    assert got.token_ids == expected
    plain = generate_grid(tiny_ar.model, ids, GRID, tiny_ar.t2i, GREEDY, 0, prefix=prefix)
    assert plain.token_ids != expected  # guidance changes the grid
    assert generate_grid(tiny_ar.model, ids, GRID, tiny_ar.t2i, GREEDY, 0, prefix=prefix, guidance=1.0).token_ids \
        == plain.token_ids  # 1 turns it off


def test_the_unconditional_row_sees_only_the_last_ten_prompt_tokens_from_position_zero(tiny_ar, prefix):
    short = prompt_ids_for(tiny_ar.tokenizer, "a cat", GRID)
    long = prompt_ids_for(tiny_ar.tokenizer, "a dog sleeping beside the fireplace at night", GRID)
    assert short[-UNCOND_PROMPT_TOKENS:] == long[-UNCOND_PROMPT_TOKENS:] and short != long
    streams = [DecodeStream(tiny_ar.model, ids, GRID, tiny_ar.t2i, GREEDY, 1, prefix=prefix, guidance=SCALE)
               for ids in (short, long)]
    assert [s.uncond.prompt_len for s in streams] == [UNCOND_PROMPT_TOKENS] * 2
    assert streams[0].uncond_offset == len(short) - UNCOND_PROMPT_TOKENS
    assert torch.equal(streams[0].uncond.logits, streams[1].uncond.logits)
    torch.testing.assert_close(streams[0].uncond.logits[0], last_logits(tiny_ar.model, short[-UNCOND_PROMPT_TOKENS:]))


# -- where the mix happens: hand-made logits through the sampler --------------------------------------------------------

OFFSET = 100
COND = [3.0, 2.9, 0.0, 0.0, 0.0, 5.0]
UNCOND = [3.0, 1.0, 0.0, 0.0, 0.0, -5.0]  # mixed at scale 2: [3, 4.8, 0, 0, 0, 15]


def draw_guided(allowed, params, seed, scale=2.0):
    logits = torch.tensor([COND, UNCOND])
    draw = (allowed, params, seed, 0)
    rows = RowSampling.build([guided(draw, scale, 1), draw], "cpu")
    return int(sample_rows(logits, OFFSET, rows)[0])


def test_the_mix_comes_before_the_range_top_k_and_top_p():
    visual = (100, 104)  # id 105 is out of range: its mixed logit (15) would win, its conditional one (5) too
    for seed in range(20):
        assert draw_guided(visual, SamplingParams(1.0, 1, 1.0), seed) == 101  # top-1 of the mix; of cond alone: 100
        assert draw_guided(visual, SamplingParams(1.0, 0, 1e-6), seed) == 101  # top-p likewise
    assert draw_guided(visual, SamplingParams(0.0, 0, 1.0), 0) == 101  # greedy
    assert draw_guided((105, 105), SamplingParams(1.0, 0, 1.0), 3) == 105  # a forced id (the EOL column) stays forced


def test_temperature_applies_to_the_mixed_logits():
    """A guided draw equals the unguided draw of the logits mixed by hand, seed for seed, at any temperature."""
    mixed = torch.tensor(UNCOND) + (torch.tensor(COND) - torch.tensor(UNCOND)) * 2.0
    for temperature in (0.3, 1.0, 1.7):
        for seed in range(30):
            params = SamplingParams(temperature, 0, 1.0)
            by_hand = sample_rows(mixed[None], OFFSET, RowSampling.build([((100, 104), params, seed, 0)], "cpu"))
            assert draw_guided((100, 104), params, seed) == int(by_hand[0])


def test_an_unguided_row_draws_what_it_drew_without_guidance_support():
    logits = torch.tensor([COND, UNCOND])
    draws = [((100, 105), SamplingParams(1.0, 0, 1.0), seed, 4) for seed in (1, 2)]
    plain = sample_rows(logits, OFFSET, RowSampling.build(draws, "cpu"))
    scale_one = sample_rows(logits, OFFSET, RowSampling.build([guided(draws[0], 1.0, 1), draws[1]], "cpu"))
    assert torch.equal(plain, scale_one)


# -- the decode paths --------------------------------------------------------------------------------------------------


def _stream(tiny_ar, prefix, prompt, size, seed, rows, guidance, reserve=True):
    grid = grid_for_size(*size, 16)
    ids = prompt_ids_for(tiny_ar.tokenizer, prompt, grid)
    t2i = tiny_ar.t2i
    return DecodeStream(tiny_ar.model, ids, grid, t2i, SamplingParams(1.0, t2i.top_k, 1.0), seed,
                        lambda r, h, t: rows.append(h), prefix=prefix, reserve=reserve, guidance=guidance)


def test_a_guided_stream_is_batch_invariant_in_the_eager_decoder(tiny_ar, prefix):
    """Alone, and among guided and unguided streams joining late (its unconditional row lands on other rows)."""
    t2i = tiny_ar.t2i
    ids = prompt_ids_for(tiny_ar.tokenizer, "a cat", GRID)
    alone = generate_grid(tiny_ar.model, ids, GRID, t2i, SamplingParams(1.0, t2i.top_k, 1.0), 5, prefix=prefix,
                          guidance=SCALE, pad_to=8)
    rows: list[torch.Tensor] = []
    target = _stream(tiny_ar, prefix, "a cat", (64, 64), 5, rows, SCALE)
    joiners = [_stream(tiny_ar, prefix, f"dog {k}", (32 + 16 * k, 48), 100 + k, [], 1.0 + 2 * (k % 2)) for k in range(3)]
    decode_together(EagerDecoder(tiny_ar.model, pad_to=8), [target], joiners, join_every=2)
    assert target.tokens == alone.token_ids
    assert torch.equal(torch.cat(rows), alone.image_condition)


@pytest.mark.parametrize("lookahead", [False, True])
def test_fixed_slot_decode_gives_the_eager_guided_grid_and_frees_both_slots(tiny_ar, prefix, lookahead):
    t2i = tiny_ar.t2i
    sampling = SamplingParams(1.0, t2i.top_k, 1.0)
    ids = prompt_ids_for(tiny_ar.tokenizer, "a lighthouse", GRID)
    eager = generate_grid(tiny_ar.model, ids, GRID, t2i, sampling, 9, prefix=prefix, guidance=SCALE, pad_to=4)
    static = StaticDecoder(tiny_ar.model, slots=4, max_positions=200)
    static.lookahead = lookahead
    fast = generate_grid(tiny_ar.model, ids, GRID, t2i, sampling, 9, prefix=prefix, guidance=SCALE,
                         decoder=SlotDecoder(static))
    assert fast.token_ids == eager.token_ids
    torch.testing.assert_close(fast.image_condition, eager.image_condition, rtol=1e-4, atol=1e-5)
    assert static.free_slots == 4
    if lookahead:
        assert static.ahead_taken == len(fast.token_ids) - 2 and static.ahead_wasted == 0


def test_full_length_fixed_slots_keep_a_guided_stream_batch_invariant_to_the_bit(tiny_ar, prefix):
    static = StaticDecoder(tiny_ar.model, slots=8, max_positions=200, full_length=True)
    decoder = SlotDecoder(static)
    alone_rows: list[torch.Tensor] = []
    alone = _stream(tiny_ar, prefix, "a cat", (64, 64), 5, alone_rows, SCALE, reserve=False)
    decoder.admit(alone)
    decode_together(decoder, [alone])
    rows: list[torch.Tensor] = []
    joiners = [_stream(tiny_ar, prefix, f"dog {k}", (32 + 16 * k, 48), 100 + k, [], SCALE, reserve=False) for k in range(2)]
    for joiner in joiners:
        decoder.admit(joiner)
    target = _stream(tiny_ar, prefix, "a cat", (64, 64), 5, rows, SCALE, reserve=False)
    decoder.admit(target)  # slots 4 and 5: behind the joiners' rows
    assert (target.slot, target.uncond.slot) == (4, 5)
    decode_together(decoder, joiners + [target])
    assert target.tokens == alone.tokens
    assert torch.equal(torch.cat(rows), torch.cat(alone_rows))
    assert static.free_slots == 8


def test_the_fixed_slot_step_refuses_a_guided_row_without_its_unconditional_row(tiny_ar):
    static = StaticDecoder(tiny_ar.model, slots=2, max_positions=64)
    start = tiny_ar.config.gen_vocab_start_index
    draw = guided(((start, start + 8), SamplingParams(), 0, 0), SCALE, 1)
    with pytest.raises(ValueError, match="unconditional slot"):
        static.step([0], [start], [3], [draw])


# -- the knob and the engine --------------------------------------------------------------------------------------------


def test_the_knob_default_comes_from_the_t2i_config_else_the_released_one(tmp_path):
    base = dict(eol_token_id=512, visual_token_start_id=520, visual_token_end_id=584)
    assert T2IGenerationConfig.from_dict(base).sampling_defaults["ar_cfg_scale"] == RELEASED_AR_CFG_SCALE == 6.0
    config = T2IGenerationConfig.from_dict(base | {"cfg_scale": 3.5})
    assert config.sampling_defaults["ar_cfg_scale"] == 3.5
    config.save(tmp_path)
    assert json.loads((tmp_path / "t2i_generation_config.json").read_text())["cfg_scale"] == 3.5
    assert T2IGenerationConfig.load(tmp_path) == config


def _rows_of(got) -> list[list[int]]:
    return [e.token_ids for e in got if isinstance(e, events.TokenRow)]


def test_engine_guides_by_default_and_image_i_of_n_is_seed_plus_i(tiny_ar, tiny_root):
    engine = make_engine(tiny_ar, open_checkpoint(tiny_root), FakeRenderer(), max_batch_size=4)
    try:
        plan = engine.plan(prompt="a harbour", width=64, height=64, seed=40, n=2)
        assert plan.guidance == RELEASED_AR_CFG_SCALE and plan.knobs["ar_cfg_scale"] == RELEASED_AR_CFG_SCALE
        got = wait_done(engine.submit(plan, mode="tokens"))
        assert isinstance(got[-1], events.JobDone) and got[-1].knobs["ar_cfg_scale"] == RELEASED_AR_CFG_SCALE
        second = [e.token_ids for e in got if isinstance(e, events.TokenRow) and e.index == 1]
        alone = wait_done(engine.submit(engine.plan(prompt="a harbour", width=64, height=64, seed=41), mode="tokens"))
        assert _rows_of(alone) == second
        off = wait_done(engine.submit(engine.plan(prompt="a harbour", width=64, height=64, seed=41,
                                                  knobs={"ar_cfg_scale": 1}), mode="tokens"))
        assert _rows_of(off) != second
        t2i = tiny_ar.t2i
        ids = prompt_ids_for(tiny_ar.tokenizer, "a harbour", GRID)
        expected = generate_grid(tiny_ar.model, ids, GRID, t2i, SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p),
                                 41, guidance=RELEASED_AR_CFG_SCALE)
        assert [t for row in second for t in row] == [t for i, t in enumerate(expected.token_ids[:-1]) if i % 5 != 4]
        with pytest.raises(RequestRejected, match="'ar_cfg_scale' must be >= 1") as refused:
            engine.plan(prompt="a harbour", width=64, height=64, knobs={"ar_cfg_scale": 0.5})
        assert refused.value.param == "ar_cfg_scale"
        card = {entry["knob"].name: entry["default"] for entry in engine.model_card()["knobs"]}
        assert card["ar_cfg_scale"] == RELEASED_AR_CFG_SCALE
    finally:
        engine.close()
