import pytest
import torch

from ar_service.sampling import SamplingParams, sample_next


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _logits():
    torch.manual_seed(1)
    return torch.randn(3, 50)


def test_top_k_one_is_argmax_within_range():
    logits = _logits()
    logits[:, 0] = 100.0  # the global best lies outside the allowed range
    got = sample_next(logits, (10, 20), SamplingParams(1.0, 1, 1.0), _gen())
    assert torch.equal(got, logits[:, 10:21].argmax(-1) + 10)


def test_temperature_zero_is_greedy():
    logits = _logits()
    got = sample_next(logits, (5, 40), SamplingParams(0.0, 0, 1.0), _gen())
    assert torch.equal(got, logits[:, 5:41].argmax(-1) + 5)


def test_small_top_p_keeps_only_the_top_token():
    logits = _logits()
    expected = logits[:, 0:30].argmax(-1)
    for seed in range(5):
        assert torch.equal(sample_next(logits, (0, 29), SamplingParams(1.0, 0, 1e-6), _gen(seed)), expected)


def test_samples_stay_in_range_and_follow_the_seed():
    logits = torch.zeros(1, 100)
    draws = [int(sample_next(logits, (40, 59), SamplingParams(), _gen(7))) for _ in range(3)]
    assert len(set(draws)) == 1
    many = {int(sample_next(logits, (40, 59), SamplingParams(), _gen(s))) for s in range(50)}
    assert many <= set(range(40, 60)) and len(many) > 5


def test_single_id_range_is_forced():
    got = sample_next(torch.randn(2, 10), (4, 4), SamplingParams(1.0, 2048, 1.0), _gen())
    assert got.tolist() == [4, 4]


def test_bad_range_raises():
    with pytest.raises(ValueError):
        sample_next(torch.zeros(1, 10), (5, 10), SamplingParams(), _gen())
