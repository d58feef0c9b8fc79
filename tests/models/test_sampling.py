"""Sampling on distributions whose answers are known: temperature -> top-k -> top-p."""

import math

import pytest
import torch

from models import ConfigError, SamplingParams
from models.sampling import filter_logits, sample

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])


def _kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_top_k_one_equals_greedy():
    logits = torch.randn(64, 50)
    picked = sample(logits, SamplingParams(temperature=1.3, top_k=1), torch.Generator().manual_seed(0))
    assert torch.equal(picked, sample(logits, SamplingParams(greedy=True)))
    assert torch.equal(picked, logits.argmax(-1))


@pytest.mark.parametrize("top_p, kept", [(0.4, {1}), (0.75, {1, 3}), (0.9, {1, 3, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    assert _kept(filter_logits(PROBS.log(), top_p=top_p)) == kept


def test_top_k_keeps_the_k_most_likely():
    assert _kept(filter_logits(PROBS.log(), top_k=2)) == {1, 3}


def test_temperature_is_applied_before_top_p():
    """At temperature 3 the distribution flattens, so reaching 75% of the mass needs a third token."""
    flattened = (PROBS.log() / 3).softmax(-1)
    assert flattened[0, 1] + flattened[0, 3] < 0.75
    picks = {int(sample(PROBS.log(), SamplingParams(temperature=3.0, top_p=0.75), torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert picks == {1, 3, 2}


def test_samples_follow_the_distribution():
    logits = PROBS.log().expand(40_000, 4)
    picks = sample(logits, SamplingParams(), torch.Generator().manual_seed(0))
    frequencies = torch.bincount(picks, minlength=4).float() / len(picks)
    standard_error = math.sqrt(0.25 / len(picks))
    torch.testing.assert_close(frequencies, PROBS[0], atol=5 * standard_error, rtol=0)


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(8, 100)
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.95)
    first = sample(logits, params, torch.Generator().manual_seed(3))
    assert torch.equal(first, sample(logits, params, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_p=1.5), "top_p must lie in"),
])
def test_invalid_params(settings, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**settings)
