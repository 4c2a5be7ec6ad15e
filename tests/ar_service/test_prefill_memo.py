"""Repeated prefills kept by their token ids (``PrefillMemo``), on the tiny model: a kept negative condition or
unconditional row is exactly the prefill it replaces, guided images decode the same with or without the memo (on
the eager decoder, which grows its caches in place, and in fixed slots), the oldest entry goes first, and the
engine counts its hits and misses in its metrics."""

from __future__ import annotations

import pytest
import torch

from ar_service import events
from ar_service.conditions import negative_prompt_ids, prompt_ids_for
from ar_service.decoding.decoders import SlotDecoder
from ar_service.decoding.stream import UNCOND_PROMPT_TOKENS
from ar_service.generation import generate_grid
from ar_service.model.static_decode import StaticDecoder
from ar_service.prefill import (
    PREFILL_MEMO_ENTRIES,
    PrefillMemo,
    build_prefix_cache,
    negative_condition_for,
    system_prefix_ids,
)
from ar_service.prompt import grid_for_size
from ar_service.sampling import SamplingParams
from ar_service.settings import ARSettings
from servicekit.checkpoint import open_checkpoint
from tests.ar_service.test_ar_batching import FakeRenderer, assert_same, conditions, make_engine, wait_done

GRID = grid_for_size(64, 64, 16)
SCALE = 7.0


@pytest.fixture(scope="module")
def prefix(tiny_ar):
    return build_prefix_cache(tiny_ar.model, system_prefix_ids(tiny_ar.tokenizer))


def test_a_kept_negative_condition_is_the_prefill_itself_and_the_oldest_goes_first(tiny_ar, prefix):
    model, tok = tiny_ar.model, tiny_ar.tokenizer
    ids = {text: negative_prompt_ids(tok, text) for text in ("blurry", "dark", "noisy")}
    fresh = {text: negative_condition_for(model, i, prefix=prefix)[0] for text, i in ids.items()}
    seen: list[tuple[str, bool]] = []
    memo = PrefillMemo(entries=2, on_lookup=lambda kind, hit: seen.append((kind, hit)))
    first, _ = negative_condition_for(model, ids["blurry"], prefix=prefix, memo=memo)
    again, _ = negative_condition_for(model, ids["blurry"], prefix=prefix, memo=memo)
    assert again is first and torch.equal(again, fresh["blurry"])
    for text in ("dark", "noisy"):  # two more: "blurry" is the least recently used, and goes
        assert torch.equal(negative_condition_for(model, ids[text], prefix=prefix, memo=memo)[0], fresh[text])
    assert len(memo) == 2
    assert negative_condition_for(model, ids["blurry"], prefix=prefix, memo=memo)[0] is not first
    assert seen == [("negative", False), ("negative", True), ("negative", False), ("negative", False),
                    ("negative", False)]
    assert (memo.hits, memo.misses) == (1, 4)


def test_a_memo_keeps_at_least_one_entry():
    with pytest.raises(ValueError, match="entries must be >= 1"):
        PrefillMemo(0)


def _decoder(kind: str, model) -> dict:
    """generate_grid's decoder argument: its default eager decoder, or fixed slots."""
    return {} if kind == "eager" else {"decoder": SlotDecoder(StaticDecoder(model, slots=4, max_positions=200))}


@pytest.mark.parametrize("kind", ["eager", "slots"])
def test_guided_images_of_one_size_decode_the_same_with_the_memo(tiny_ar, prefix, kind):
    """Two prompts share their last 10 tokens (the size header): the second image takes the first one's
    unconditional row from the memo. The eager decoder grows that row's cache while decoding the first image; the
    second must still start from the prompt's 10 positions."""
    t2i = tiny_ar.t2i
    sampling = SamplingParams(1.0, t2i.top_k, 1.0)
    prompts = [prompt_ids_for(tiny_ar.tokenizer, text, GRID) for text in ("a lighthouse", "two cats on a sofa")]
    assert prompts[0][-UNCOND_PROMPT_TOKENS:] == prompts[1][-UNCOND_PROMPT_TOKENS:]

    def decode(ids, seed, memo):
        return generate_grid(tiny_ar.model, ids, GRID, t2i, sampling, seed, prefix=prefix, guidance=SCALE,
                             memo=memo, **_decoder(kind, tiny_ar.model))

    alone = [decode(ids, 3 + k, None) for k, ids in enumerate(prompts)]
    memo = PrefillMemo()
    kept = [decode(ids, 3 + k, memo) for k, ids in enumerate(prompts)]
    assert (memo.hits, memo.misses) == (1, 1)
    for got, expected in zip(kept, alone, strict=True):
        assert got.token_ids == expected.token_ids
        assert torch.equal(got.image_condition, expected.image_condition)
    again = decode(prompts[0], 3, memo)  # the kept row again, after both images decoded from it
    assert again.token_ids == alone[0].token_ids and memo.hits == 2


def test_the_engine_counts_its_memo_and_sends_what_an_engine_without_it_sends(tiny_ar, tiny_root):
    """Three guided requests of one size with the default negative prompt, through an engine with the memo and one
    without: the same conditions go to the DiT; the memo's engine prefilled the negative prompt and the
    unconditional row once each."""
    assert ARSettings.model_fields["prefill_memo"].default == PREFILL_MEMO_ENTRIES
    checkpoint = open_checkpoint(tiny_root)
    sent = {}
    for entries in (PREFILL_MEMO_ENTRIES, 0):
        renderer = FakeRenderer()
        engine = make_engine(tiny_ar, checkpoint, renderer, max_batch_size=2, prefill_memo=entries)
        try:
            for k in range(3):
                plan = engine.plan(request_id=f"r{k}", prompt=f"scene {k}", width=64, height=64, seed=k,
                                   knobs={"num_inference_steps": 1})
                assert isinstance(wait_done(engine.submit(plan))[-1], events.JobDone)
            sent[entries] = [conditions(renderer, f"r{k}") for k in range(3)]
            registry = engine.metrics.registry
            counts = {(kind, result): registry.get_sample_value(
                "ardit_ar_prefill_memo_lookups_total", {"kind": kind, "result": result})
                for kind in ("negative", "unconditional") for result in ("hit", "miss")}
        finally:
            engine.close()
        if entries:
            assert counts == {("negative", "hit"): 2, ("negative", "miss"): 1,
                              ("unconditional", "hit"): 2, ("unconditional", "miss"): 1}
            negatives = [[h for kind, _, h in request[0] if kind == "negative"] for request in sent[entries]]
            assert all(len(n) > 0 and torch.equal(n[0], negatives[0][0]) for n in negatives)
        else:
            assert engine.memo is None and set(counts.values()) == {None}
    for with_memo, without in zip(sent[PREFILL_MEMO_ENTRIES], sent[0], strict=True):
        assert_same(with_memo, without)
