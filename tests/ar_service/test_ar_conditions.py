"""What the AR hands the DiT where the released MammothModa2 code and ardit's defaults part ways, on the tiny model:
the image condition's scope, the negative branch, the visual range; each behind a checkpoint serving setting.

Hand references run the model over a whole sequence from position 0 without a cache (as the released code
re-encodes prompt + grid + ``<|image end|>`` in one forward).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ar_service import events
from ar_service.conditions import (
    ANSWER_WINDOW,
    image_condition_positions,
    negative_prompt_ids,
    prompt_ids_for,
    text_condition_mask,
)
from ar_service.generation import generate_grid
from ar_service.model.tiny import PREVIEW_T2I, tiny_t2i
from ar_service.model.tokenizer import IMAGE_END_TOKEN
from ar_service.prefill import build_prefix_cache, negative_condition_for, system_prefix_ids
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from servicekit.checkpoint import RELEASED_NEGATIVE_PROMPT, ServingDefaults, open_checkpoint
from tests.ar_service.test_ar_batching import FakeRenderer, make_engine, wait_done

GRID = grid_for_size(64, 64, 16)  # 4x4: 20 grid positions
SAMPLING = SamplingParams(1.0, 2048, 1.0)


@pytest.fixture(scope="module")
def prefix(tiny_ar):
    return build_prefix_cache(tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer))


@pytest.fixture(scope="module")
def image_end(tiny_ar):
    return tiny_ar.tokenizer.convert_tokens_to_ids(IMAGE_END_TOKEN)


def full_states(model, ids: list[int]) -> torch.Tensor:
    """Condition states of every position of ``ids``, one forward from position 0: [L, H]."""
    _, hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], None, num_logits=1)
    return hidden[0]


def engine_with(tiny_ar, tiny_root, **serving):
    checkpoint = open_checkpoint(tiny_root)
    settings = {"grid_rule": "pixels_per_token", **serving}  # the tiny model's 16-pixel grid, as its own settings
    return make_engine(tiny_ar, replace(checkpoint, serving=ServingDefaults(**settings)), FakeRenderer(), max_batch_size=2)


# -- which generated rows become the image condition -----------------------------------------------------------------


def test_the_answer_window_is_the_released_split_of_prompt_grid_and_image_end(tiny_ar, prefix, image_end):
    ids = prompt_ids_for(tiny_ar.tokenizer, "a red apple", GRID)
    everything = generate_grid(tiny_ar.model, ids, GRID, tiny_ar.t2i, SAMPLING, 3, prefix=prefix, guidance=6.0)
    window = generate_grid(tiny_ar.model, ids, GRID, tiny_ar.t2i, SAMPLING, 3, prefix=prefix, guidance=6.0,
                           condition_scope=ANSWER_WINDOW, image_end_id=image_end)
    assert window.token_ids[:-1] == everything.token_ids[:-1]  # the same grid; <|image end|> instead of a look-ahead
    assert window.token_ids[-1] == image_end
    hidden = tiny_ar.config.hidden_size
    assert everything.image_condition.shape == (GRID.condition_positions, hidden) == (20, hidden)
    assert window.image_condition.shape == (10, hidden)
    assert image_condition_positions(ids, GRID, ANSWER_WINDOW, tiny_ar.config) == 10
    sequence = ids + window.token_ids  # prompt + grid + <|image end|>, as the released code re-encodes it
    states = full_states(tiny_ar.model, sequence)
    torch.testing.assert_close(window.image_condition, states[-10:], rtol=1e-4, atol=1e-5)  # all 10 are gen ids
    torch.testing.assert_close(window.image_condition[:9], everything.image_condition[-9:])
    assert torch.equal(window.text_condition, everything.text_condition)  # the question is the whole prompt


def test_a_window_longer_than_the_grid_reaches_into_the_prompt(tiny_ar, prefix, image_end):
    """A 1x1 grid: 2 grid positions + <|image end|>; the other 7 window positions are prompt tokens, of which the
    generation-vocabulary ones (<|image start|>, <|image token|>) join the image condition, and none of the 7 is
    text condition any more."""
    grid = grid_for_size(16, 16, 16)
    ids = prompt_ids_for(tiny_ar.tokenizer, "a cat", grid)
    start = tiny_ar.config.gen_vocab_start_index
    assert sum(t >= start for t in ids[-7:]) == 2
    result = generate_grid(tiny_ar.model, ids, grid, tiny_ar.t2i, SAMPLING, 1, prefix=prefix,
                           condition_scope=ANSWER_WINDOW, image_end_id=image_end)
    assert result.image_condition.shape[0] == image_condition_positions(ids, grid, ANSWER_WINDOW, tiny_ar.config) == 5
    sequence = ids + result.token_ids
    states = full_states(tiny_ar.model, sequence)
    in_window = torch.tensor(sequence[-10:]) >= start
    torch.testing.assert_close(result.image_condition, states[-10:][in_window], rtol=1e-4, atol=1e-5)
    text = text_condition_mask(ids, tiny_ar.config, len(ids) - 7)
    assert not text[-7:].any()
    torch.testing.assert_close(result.text_condition, states[: len(ids)][text], rtol=1e-4, atol=1e-5)


def test_the_engine_sends_the_window_once_the_image_end_is_fed(tiny_ar, tiny_root, image_end):
    engine = engine_with(tiny_ar, tiny_root, condition_scope="answer_window")
    try:
        plan = engine.plan(request_id="w", prompt="a red apple", width=64, height=64, seed=3,
                           knobs={"text_guidance_scale": 1.0, "num_inference_steps": 1})
        assert plan.image_positions == 10
        renderer = engine.renderer
        assert isinstance(wait_done(engine.submit(plan))[-1], events.JobDone)
        [session] = renderer.sessions
        assert session.header.image_positions == 10
        assert [(kind, offset, tuple(h.shape)) for kind, offset, h in session.sent] == [
            ("text", 0, (plan.text_positions, 64)), ("image", 0, (10, 64))]
        t2i = tiny_ar.t2i
        expected = generate_grid(tiny_ar.model, plan.prompt_ids, GRID, t2i, SamplingParams(1.0, 2048, 1.0), 3,
                                 guidance=6.0, condition_scope=ANSWER_WINDOW, image_end_id=image_end, pad_to=4)
        torch.testing.assert_close(session.sent[1][2], expected.image_condition)
    finally:
        engine.close()


def test_all_generated_rows_stream_row_by_row_by_default(tiny_ar, tiny_root):
    engine = engine_with(tiny_ar, tiny_root)
    try:
        plan = engine.plan(request_id="a", prompt="a red apple", width=64, height=64, seed=3,
                           knobs={"text_guidance_scale": 1.0, "num_inference_steps": 1})
        assert plan.image_positions == GRID.condition_positions
        assert isinstance(wait_done(engine.submit(plan))[-1], events.JobDone)
        [session] = engine.renderer.sessions
        assert [(kind, offset, h.shape[0]) for kind, offset, h in session.sent][1:] == [
            ("image", row * 5, 5) for row in range(4)]
    finally:
        engine.close()


# -- the negative (unconditional) branch ------------------------------------------------------------------------------


def test_the_negative_branch_is_system_and_user_messages_with_every_position(tiny_ar, prefix):
    ids = negative_prompt_ids(tiny_ar.tokenizer, "blurry")
    assert tiny_ar.tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful image generator.<|im_end|>\n<|im_start|>user\nblurry<|im_end|>\n"
    )
    assert max(ids) < tiny_ar.config.gen_vocab_start_index  # no image header
    condition, _ = negative_condition_for(tiny_ar.model, ids, prefix=prefix)
    assert condition.shape == (len(ids), tiny_ar.config.hidden_size)  # nothing masked: special tokens too
    torch.testing.assert_close(condition, full_states(tiny_ar.model, ids), rtol=1e-4, atol=1e-5)


def _negative_sent(engine, **request):
    engine.renderer.sessions.clear()
    plan = engine.plan(prompt="a red apple", width=32, height=32, seed=1, **request)
    assert isinstance(wait_done(engine.submit(plan))[-1], events.JobDone)
    [session] = engine.renderer.sessions
    negative = [h for kind, _, h in session.sent if kind == "negative"]
    assert session.header.negative_positions == sum(h.shape[0] for h in negative)
    return negative


def test_the_engine_uses_the_default_negative_prompt_unless_told_otherwise(tiny_ar, tiny_root, prefix):
    steps = {"num_inference_steps": 1}
    engine = engine_with(tiny_ar, tiny_root)
    try:
        assert engine.choices.default_negative_prompt == RELEASED_NEGATIVE_PROMPT
        [default] = _negative_sent(engine, knobs=steps)
        released_ids = negative_prompt_ids(tiny_ar.tokenizer, RELEASED_NEGATIVE_PROMPT)
        assert torch.equal(default, negative_condition_for(tiny_ar.model, released_ids, prefix=prefix)[0])
        [own] = _negative_sent(engine, negative_prompt="blurry", knobs=steps)
        assert own.shape[0] == len(negative_prompt_ids(tiny_ar.tokenizer, "blurry"))
        assert _negative_sent(engine, knobs=steps | {"text_guidance_scale": 1.0}) == []  # no guidance, no prefill
    finally:
        engine.close()
    engine = engine_with(tiny_ar, tiny_root, default_negative_prompt="")
    try:
        assert _negative_sent(engine, knobs=steps) == []  # the empty condition, as vllm-omni
        assert len(_negative_sent(engine, negative_prompt="blurry", knobs=steps)) == 1
    finally:
        engine.close()


# -- the visual range -------------------------------------------------------------------------------------------------


def test_the_released_visual_scope_runs_to_the_end_of_the_vocabulary():
    assert PREVIEW_T2I.visual_range == (152072, 168455)
    assert PREVIEW_T2I.with_released_scope(152064 + 32800).visual_range == (152072, 184863)
    tiny = tiny_t2i()
    assert tiny.with_released_scope(584).visual_token_end_id == 584 == tiny.visual_token_end_id  # no room beyond


def test_the_visual_scope_setting_changes_what_the_grid_may_hold(tiny_ar, tiny_root, prefix):
    narrow = replace(tiny_ar.t2i, visual_token_end_id=tiny_ar.t2i.visual_token_start_id + 8)
    grid = grid_for_size(96, 96, 16)  # 36 visual tokens
    ids = prompt_ids_for(tiny_ar.tokenizer, "a cat", grid)
    visual = lambda tokens: [t for i, t in enumerate(tokens[:-1]) if i % 7 != 6]  # noqa: E731
    fixed = generate_grid(tiny_ar.model, ids, grid, narrow, SAMPLING, 2, prefix=prefix)
    assert all(narrow.visual_token_start_id <= t < narrow.visual_token_end_id for t in visual(fixed.token_ids))
    released = narrow.with_released_scope(tiny_ar.config.total_vocab_size)
    wide = generate_grid(tiny_ar.model, ids, grid, released, SAMPLING, 2, prefix=prefix)
    assert max(visual(wide.token_ids)) >= narrow.visual_token_end_id
    assert max(visual(wide.token_ids)) < tiny_ar.config.total_vocab_size
    engine = engine_with(tiny_ar, tiny_root, visual_token_scope="start_plus_end")
    try:
        assert engine.choices.t2i.visual_token_end_id == tiny_ar.config.total_vocab_size
    finally:
        engine.close()
