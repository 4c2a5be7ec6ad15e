import math

import pytest
import torch

from dit_service.model.sampler import DenoiseCancelled, denoise, make_scheduler, resolution_shift


class CountingTransformer:
    """Counts real forward calls of the wrapped model."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def _run(pipeline, condition, empty_condition, **overrides):
    counter = CountingTransformer(pipeline.transformer)
    args = dict(
        seed=0, steps=4, guidance=4.0, cfg_range=(0.0, 1.0), scheduler_config=pipeline.scheduler_config
    )
    args.update(overrides)
    result = denoise(counter, condition, empty_condition, (16, 8, 8), **args)
    return result, counter.calls


@pytest.mark.parametrize(
    ("guidance", "cfg_range", "calls"),
    [
        (4.0, (0.0, 1.0), 8),
        (4.0, (0.25, 0.5), 6),
        (4.0, (0.0, 0.0), 5),
        (4.0, (0.5, 0.5), 5),
        (4.0, (1.0, 1.0), 4),
        (1.0, (0.0, 1.0), 4),
        (0.5, (0.0, 1.0), 4),
    ],
)
def test_cfg_call_counts(pipeline, condition, empty_condition, guidance, cfg_range, calls):
    result, counted = _run(pipeline, condition, empty_condition, guidance=guidance, cfg_range=cfg_range)
    assert counted == calls == result.transformer_calls


def test_guidance_changes_the_result(pipeline, condition, empty_condition):
    plain, _ = _run(pipeline, condition, empty_condition, guidance=1.0)
    guided, _ = _run(pipeline, condition, empty_condition, guidance=4.0)
    assert not torch.equal(plain.latents, guided.latents)


def test_cancel_raises_after_the_current_step(pipeline, condition, empty_condition):
    done = []
    with pytest.raises(DenoiseCancelled) as caught:
        _run(pipeline, condition, empty_condition, guidance=1.0,
             on_step=lambda step, total: done.append((step, total)), should_stop=lambda: len(done) >= 2)
    assert done == [(1, 4), (2, 4)]
    assert caught.value.steps_done == 2


def test_resolution_shift_is_3_2_at_1024_and_schedule_is_fresh(pipeline):
    assert resolution_shift(128, 128) == pytest.approx(3.2)
    a = make_scheduler(pipeline.scheduler_config, 4, 128, 128, "cpu")
    b = make_scheduler(pipeline.scheduler_config, 4, 128, 128, "cpu")
    assert a is not b
    m = 3.2
    expected = [m * s / (1 + (m - 1) * s) for s in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert a.sigmas.tolist() == pytest.approx(expected, abs=1e-6)
    assert math.isclose(a.sigmas[0].item(), 1.0)
