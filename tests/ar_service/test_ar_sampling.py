import math

import pytest
import torch

from ar_service.sampling import RowSampling, SamplingParams, gumbel_noise, sample_rows


def _draw(logits, offset, rng, params, seed=0, step=0):
    rows = RowSampling.build([(rng, params, seed, step)] * logits.shape[0], logits.device)
    return sample_rows(logits, offset, rows)


def _logits():
    torch.manual_seed(1)
    return torch.randn(3, 50)


def test_top_k_one_is_argmax_within_range():
    logits = _logits()
    logits[:, 0] = 100.0  # the global best lies outside the allowed range
    got = _draw(logits, 0, (10, 20), SamplingParams(1.0, 1, 1.0))
    assert torch.equal(got, logits[:, 10:21].argmax(-1) + 10)


def test_temperature_zero_is_greedy():
    logits = _logits()
    got = _draw(logits, 0, (5, 40), SamplingParams(0.0, 0, 1.0), seed=9)
    assert torch.equal(got, logits[:, 5:41].argmax(-1) + 5)


def test_small_top_p_keeps_only_the_top_token():
    logits = _logits()
    expected = logits[:, 0:30].argmax(-1)
    for seed in range(5):
        assert torch.equal(_draw(logits, 0, (0, 29), SamplingParams(1.0, 0, 1e-6), seed=seed), expected)


def test_top_k_restricts_the_draw_to_the_k_best():
    logits = torch.arange(40, dtype=torch.float32)[None] / 10  # the best ids are the highest
    drawn = {int(_draw(logits, 0, (0, 39), SamplingParams(1.0, 3, 1.0), seed=s)[0]) for s in range(200)}
    assert drawn == {37, 38, 39}


def test_draws_follow_the_seed_and_step_and_stay_in_range():
    logits = torch.zeros(1, 100)
    same = {int(_draw(logits, 0, (40, 59), SamplingParams(), seed=7, step=3)) for _ in range(3)}
    assert len(same) == 1
    many = {int(_draw(logits, 0, (40, 59), SamplingParams(), seed=s)) for s in range(50)}
    assert many <= set(range(40, 60)) and len(many) > 5
    steps = {int(_draw(logits, 0, (40, 59), SamplingParams(), seed=7, step=t)) for t in range(50)}
    assert len(steps) > 5


def test_the_draw_follows_the_softmax_distribution():
    """Gumbel-max over many seeds: frequencies match softmax(logits / T) within sampling error."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    params = SamplingParams(0.7, 0, 1.0)
    n = 4000
    rows = RowSampling.build([((0, 3), params, seed, 0) for seed in range(n)], "cpu")
    drawn = sample_rows(logits.expand(n, -1), 0, rows)
    freq = torch.bincount(drawn, minlength=4).float() / n
    expected = (logits[0] / 0.7).softmax(-1)
    assert torch.allclose(freq, expected, atol=4 * math.sqrt(0.25 / n))


def test_a_rows_draw_does_not_depend_on_the_other_rows():
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    specs = [((8, 60), SamplingParams(1.0, 16, 0.9), 11, 5), ((0, 63), SamplingParams(0.5, 0, 1.0), 12, 0),
             ((8, 8), SamplingParams(), 0, 0), ((20, 30), SamplingParams(0.0, 0, 1.0), 13, 2)]
    # ranges are absolute ids: offset 100 shifts them
    specs = [((lo + 100, hi + 100), p, seed, step) for (lo, hi), p, seed, step in specs]
    together = sample_rows(logits, 100, RowSampling.build(specs, "cpu"))
    for i, spec in enumerate(specs):
        alone = sample_rows(logits[i : i + 1], 100, RowSampling.build([spec], "cpu"))
        assert int(alone[0]) == int(together[i])
    assert int(together[2]) == 108  # a one-id range is forced


def test_gumbel_noise_is_a_pure_function_of_seed_step_and_id():
    ids = torch.arange(1000)
    a = gumbel_noise(torch.tensor([2**62 + 5]), torch.tensor([3]), ids)
    b = gumbel_noise(torch.tensor([2**62 + 5]), torch.tensor([3]), ids)
    c = gumbel_noise(torch.tensor([5]), torch.tensor([3]), ids)  # differs only in the high seed bits
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.isfinite(a).all()
    # Gumbel(0, 1): mean is the Euler-Mascheroni constant, variance pi^2 / 6
    assert abs(float(a.mean()) - 0.5772) < 0.15 and abs(float(a.var()) - math.pi**2 / 6) < 0.4


def test_bad_params_raise():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
