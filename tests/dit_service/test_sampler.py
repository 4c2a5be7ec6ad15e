import math

import pytest
import torch

from dit_service.model.pipeline import DiTPipeline
from dit_service.model.sampler import DenoiseCancelled, denoise, resolution_shift, timesteps, uses_cfg


class CountingTransformer:
    def __init__(self, model):
        self.model, self.calls, self.timesteps = model, 0, []

    def __call__(self, latents, timestep, *args):
        self.calls += 1
        self.timesteps.append(float(timestep.reshape(-1)[0]))
        return self.model(latents, timestep, *args)


def _run(pipeline, cond, uncond, **overrides):
    counter = CountingTransformer(pipeline.transformer)
    args = dict(seed=0, steps=4, guidance=4.0, cfg_range=(0.0, 1.0))
    args.update(overrides)
    return denoise(counter, cond, uncond, (16, 8, 8), **args), counter


@pytest.mark.parametrize(
    ("guidance", "cfg_range", "calls"),
    [
        (4.0, (0.0, 1.0), 8),
        (4.0, (0.25, 0.5), 6),
        (4.0, (0.0, 0.0), 5),
        (4.0, (0.5, 0.5), 5),
        (4.0, (1.0, 1.0), 4),
        (5.0, (0.5, 1.0), 6),  # upstream tests/test_cfg_range.py
        (1.0, (0.0, 1.0), 4),
        (0.5, (0.0, 1.0), 4),
    ],
)
def test_cfg_call_counts(pipeline, text, empty, guidance, cfg_range, calls):
    result, counter = _run(pipeline, text, empty, guidance=guidance, cfg_range=cfg_range)
    assert counter.calls == calls == result.transformer_calls


def test_cfg_range_boundaries_are_inclusive():
    assert [uses_cfg(i, 4, 4.0, (0.25, 0.5)) for i in range(4)] == [False, True, True, False]
    assert [uses_cfg(i, 4, 4.0, (0.0, 0.0)) for i in range(4)] == [True, False, False, False]
    assert not any(uses_cfg(i, 4, 1.0, (0.0, 1.0)) for i in range(4))


@pytest.mark.parametrize(
    ("cfg_range", "per_step", "released"),
    [
        ((0.0, 1.0), 8, 8),
        ((0.0, 0.5), 7, 7),  # from 0: the same either way
        ((0.25, 0.5), 6, 4),  # step 0 lies outside: the released code never guides again
        ((0.5, 1.0), 6, 4),
        ((1.0, 1.0), 4, 4),
    ],
)
def test_cfg_range_policy_call_counts(pipeline, text, empty, cfg_range, per_step, released):
    """``per_step`` (vllm-omni, the unmerged upstream fix) decides each step; ``off_after_first_exit`` (released
    qwen25vl ``t2i_utils.py`` lines 218-219, the scale overwritten in place) stops guiding for good at the first step
    outside the range."""
    for policy, calls in (("per_step", per_step), ("off_after_first_exit", released)):
        result, counter = _run(pipeline, text, empty, cfg_range=cfg_range, cfg_range_policy=policy)
        assert counter.calls == calls == result.transformer_calls, policy


def test_the_released_cfg_range_policy_step_by_step():
    released = [uses_cfg(i, 4, 4.0, (0.0, 0.5), "off_after_first_exit") for i in range(4)]
    assert released == [uses_cfg(i, 4, 4.0, (0.0, 0.5)) for i in range(4)] == [True, True, True, False]
    assert not any(uses_cfg(i, 4, 4.0, (0.25, 1.0), "off_after_first_exit") for i in range(4))
    assert not any(uses_cfg(i, 4, 1.0, (0.0, 1.0), "off_after_first_exit") for i in range(4))
    with pytest.raises(ValueError, match="per_step, off_after_first_exit"):
        uses_cfg(0, 4, 4.0, (0.0, 1.0), "sometimes")


def test_the_pipeline_takes_the_policy_from_the_checkpoints_serving_settings(tiny_root, tmp_path):
    import shutil

    from servicekit.checkpoint import ServingDefaults, open_checkpoint, write_serving_defaults

    assert DiTPipeline.from_checkpoint(open_checkpoint(tiny_root)).cfg_range_policy == "per_step"
    root = tmp_path / "released"
    shutil.copytree(tiny_root, root)
    write_serving_defaults(root, ServingDefaults(cfg_range_policy="off_after_first_exit"))
    pipeline = DiTPipeline.from_checkpoint(open_checkpoint(root))
    entry = pipeline.start_entry(torch.zeros(3, 64), torch.zeros(0, 64), torch.zeros(0, 64), 64, 64, 0, 4, 4.0,
                                 (0.25, 1.0))
    assert entry.cfg_range_policy == "off_after_first_exit" and not entry.wants_cfg()


def test_packed_calls_once_per_step(pipeline, text, empty):
    result, counter = _run(pipeline, text, empty, cfg_mode="packed", cfg_range=(0.25, 0.5))
    assert counter.calls == result.transformer_calls == 4


def test_time_runs_from_noise_to_data_with_resolution_shift():
    assert resolution_shift(128, 128) == pytest.approx(3.2)  # 1024x1024: latent 128x128
    assert resolution_shift(64, 64) == pytest.approx(1.6)
    t = timesteps(4, 128, 128)
    m = 3.2
    expected = [s / (m - m * s + s) for s in (0.0, 0.25, 0.5, 0.75)] + [1.0]
    assert t.dtype == torch.float32 and t.tolist() == pytest.approx(expected, abs=1e-7)
    assert t[0] == 0.0 and t[-1] == 1.0 and bool((t[1:] > t[:-1]).all())
    assert timesteps(4, 128, 128, dynamic_time_shift=False).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_transformer_sees_shifted_t_and_euler_moves_toward_data(pipeline, text, empty):
    _, counter = _run(pipeline, text, empty, guidance=1.0)
    assert counter.timesteps == pytest.approx(timesteps(4, 8, 8)[:-1].tolist(), abs=1e-7)

    class Constant:  # velocity = data - noise; one full Euler pass from t=0 to 1 adds it once
        def __call__(self, latents, timestep, *args):
            return torch.ones_like(latents)

    from dit_service.model.sampler import initial_noise
    result = denoise(Constant(), text, empty, (16, 8, 8), seed=5, steps=3, guidance=1.0)
    torch.testing.assert_close(result.latents, initial_noise((16, 8, 8), 5) + 1.0)


def test_guidance_changes_the_result(pipeline, text, empty):
    plain, _ = _run(pipeline, text, empty, guidance=1.0)
    guided, _ = _run(pipeline, text, empty, guidance=4.0)
    assert not torch.equal(plain.latents, guided.latents)


@pytest.mark.parametrize("uncond_rows", [0, 3, 9])
def test_packed_equals_sequential_exactly_on_cpu(pipeline, text, image, uncond_rows):
    cond = torch.cat([text, image])
    uncond = torch.randn(uncond_rows, cond.shape[1], generator=torch.Generator().manual_seed(9))
    seq, _ = _run(pipeline, cond, uncond, cfg_mode="sequential")
    packed, _ = _run(pipeline, cond, uncond, cfg_mode="packed")
    assert torch.equal(seq.latents, packed.latents)


def test_packed_equals_sequential_when_uncond_is_longer(pipeline, text):
    uncond = torch.randn(11, text.shape[1], generator=torch.Generator().manual_seed(10))
    seq, _ = _run(pipeline, text, uncond, cfg_mode="sequential")
    packed, _ = _run(pipeline, text, uncond, cfg_mode="packed")
    assert torch.equal(seq.latents, packed.latents)


def test_cancel_raises_after_the_current_step(pipeline, text, empty):
    done = []
    with pytest.raises(DenoiseCancelled) as caught:
        _run(pipeline, text, empty, guidance=1.0,
             on_step=lambda step, total: done.append((step, total)), should_stop=lambda: len(done) >= 2)
    assert done == [(1, 4), (2, 4)]
    assert caught.value.steps_done == 2


def test_unknown_cfg_mode_is_refused(pipeline, text, empty):
    with pytest.raises(ValueError, match="cfg_mode"):
        _run(pipeline, text, empty, cfg_mode="parallel")
    assert math.isfinite(resolution_shift(1, 1))
