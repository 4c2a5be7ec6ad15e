import pytest
import torch

from ar_service.conditions import (
    ConditionLengthError,
    check_image_condition,
    image_condition_mask,
    prompt_ids_for,
    text_condition_mask,
)
from ar_service.generation import GenerationCancelled, generate_grid
from ar_service.prefill import text_condition_for
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams

GRID = grid_for_size(256, 256, 16)  # 16x16 -> 273 tokens


def _run(tiny_ar, seed, **kw):
    ids = prompt_ids_for(tiny_ar.tokenizer, "a cat on a mat", GRID)
    t2i = tiny_ar.t2i
    return generate_grid(
        tiny_ar.model, ids, GRID, t2i, SamplingParams(t2i.temperature, t2i.top_k, t2i.top_p), seed, **kw
    )


@pytest.fixture(scope="module")
def run(tiny_ar):
    rows = []
    result = _run(tiny_ar, 1234, on_row=lambda r, h, t: rows.append((r, h, t)))
    return result, rows


def test_grid_contract(run, tiny_ar):
    result, _ = run
    t2i = tiny_ar.t2i
    assert len(result.token_ids) == GRID.decode_tokens == 273
    for i, token in enumerate(result.token_ids):
        if i % (GRID.width + 1) == GRID.width:
            assert token == t2i.eol_token_id
        else:
            assert t2i.visual_token_start_id <= token < t2i.visual_token_end_id
    assert result.image_condition.shape == (GRID.condition_positions, 64)
    assert result.prefill_ms > 0 and result.decode_ms > 0


def test_rows_stream_in_order(run):
    result, rows = run
    assert [r for r, _, _ in rows] == list(range(GRID.height))
    width = GRID.width + 1
    for r, hidden, tokens in rows:
        assert hidden.shape == (width, 64)
        assert torch.equal(hidden, result.image_condition[r * width : (r + 1) * width])
        assert tokens.tolist() == result.token_ids[r * width : (r + 1) * width]


def test_text_condition(run, tiny_ar):
    result, _ = run
    ids = prompt_ids_for(tiny_ar.tokenizer, "a cat on a mat", GRID)
    mask = text_condition_mask(ids, tiny_ar.config)
    assert result.text_condition.shape == (int(mask.sum()), 64)
    assert not mask[-1] and mask[0]  # <|image token|> (gen vocab) dropped, <|im_start|> kept
    alone, ms = text_condition_for(tiny_ar.model, ids, tiny_ar.config)
    torch.testing.assert_close(alone, result.text_condition)
    assert ms > 0


def test_text_condition_drops_vision_placeholders(tiny_ar):
    cfg = tiny_ar.config
    ids = [1, cfg.vision_start_token_id, cfg.image_token_id, cfg.video_token_id, cfg.vision_end_token_id, 2, 512, 583]
    assert text_condition_mask(ids, cfg).tolist() == [True, False, False, False, False, True, False, False]


def test_image_condition_is_gen_ids_without_the_look_ahead(run, tiny_ar):
    result, _ = run
    mask = image_condition_mask(result.token_ids, tiny_ar.config)
    assert mask.shape == (GRID.decode_tokens - 1,) and mask.all()
    assert int(mask.sum()) == GRID.height * (GRID.width + 1) == result.image_condition.shape[0]
    eols = [t for i, t in enumerate(result.token_ids[:-1]) if i % (GRID.width + 1) == GRID.width]
    assert eols == [tiny_ar.t2i.eol_token_id] * GRID.height  # EOL rows are part of the condition
    check_image_condition(result.token_ids, tiny_ar.config, GRID)


def test_image_condition_length_mismatch_raises(run, tiny_ar):
    result, _ = run
    broken = list(result.token_ids)
    broken[5] = 7  # a text id inside the grid
    with pytest.raises(ConditionLengthError, match=r"272 positions; a 16x16 grid needs 16 \* \(16 \+ 1\) = 273|271 positions"):
        check_image_condition(broken, tiny_ar.config, GRID)
    with pytest.raises(ConditionLengthError):
        check_image_condition(result.token_ids[:-2], tiny_ar.config, GRID)


def test_seed_determinism(run, tiny_ar):
    result, _ = run
    again = _run(tiny_ar, 1234)
    assert again.token_ids == result.token_ids
    assert torch.equal(again.image_condition, result.image_condition)
    assert _run(tiny_ar, 1235).token_ids != result.token_ids
    _run(tiny_ar, 2**64 + 5)  # any non-negative seed is accepted


def test_cancel_stops_decoding(tiny_ar):
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 10

    with pytest.raises(GenerationCancelled):
        _run(tiny_ar, 1, should_stop=stop)
    assert len(calls) == 11


def test_on_prefill_gets_text_condition(tiny_ar):
    got = []
    result = _run(tiny_ar, 3, on_prefill=got.append)
    assert len(got) == 1 and torch.equal(got[0], result.text_condition)
