"""Step-level batching in the sampler: entries at different steps, seeds, guidance and step counts share one
transformer call per step, and each comes out bit for bit as it does alone (CPU)."""

from __future__ import annotations

import torch

from dit_service.model.sampler import denoise, start_entry, step_entries

SHAPE = (16, 8, 8)


def _specs(text, image, empty):
    g = torch.Generator().manual_seed(77)
    other = torch.randn(9, text.shape[1], generator=g)
    negative = torch.randn(4, text.shape[1], generator=g)
    cond = torch.cat([text, image])
    return [
        dict(condition=cond, uncond=empty, seed=1, steps=4, guidance=4.0, cfg_range=(0.0, 1.0)),
        dict(condition=other, uncond=negative, seed=2, steps=6, guidance=2.5, cfg_range=(0.25, 0.75)),
        dict(condition=text, uncond=empty, seed=3, steps=3, guidance=1.0, cfg_range=(0.0, 1.0)),
        dict(condition=image, uncond=negative, seed=4, steps=5, guidance=7.0, cfg_range=(0.0, 0.5)),
    ]


def _alone(pipeline, spec, cfg_mode):
    return denoise(pipeline.transformer, spec["condition"], spec["uncond"], SHAPE, seed=spec["seed"],
                   steps=spec["steps"], guidance=spec["guidance"], cfg_range=spec["cfg_range"], cfg_mode=cfg_mode).latents


def _entry(spec):
    return start_entry(spec["condition"], spec["uncond"], SHAPE, spec["seed"], spec["steps"], spec["guidance"],
                       spec["cfg_range"])


def test_batched_entries_equal_their_solo_runs_bit_for_bit(pipeline, text, image, empty):
    specs = _specs(text, image, empty)
    joins = [0, 0, 1, 3]  # entries join at different steps of the running batch
    entries: dict[int, object] = {}
    finished: dict[int, torch.Tensor] = {}
    sizes = []
    tick = 0
    while len(finished) < len(specs):
        for k, at in enumerate(joins):
            if at == tick:
                entries[k] = _entry(specs[k])
        running = list(entries.values())
        sizes.append(len(running))
        assert step_entries(pipeline.transformer, running) == 1  # one transformer call for the whole batch
        for k in [k for k, e in entries.items() if e.done]:
            finished[k] = entries.pop(k).latents
        tick += 1
    assert max(sizes) == 4
    for k, spec in enumerate(specs):
        for mode in ("packed", "sequential"):
            assert torch.equal(finished[k], _alone(pipeline, spec, mode)), (k, mode)


def test_rows_count_guided_steps_twice(pipeline, text, empty):
    entry = start_entry(text, empty, SHAPE, seed=0, steps=4, guidance=4.0, cfg_range=(0.25, 0.5))
    while not entry.done:
        step_entries(pipeline.transformer, [entry])
    assert entry.rows == 6
    entry.release()
    assert entry.latents.numel() == 0
