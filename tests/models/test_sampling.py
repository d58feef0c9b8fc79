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
    picks = {int(sample(PROBS.log(), SamplingParams(temperature=3.0, top_p=0.75),
                        torch.Generator().manual_seed(s)))
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


# 99.9% quantiles of the chi-square distribution by degrees of freedom: a fixed seed makes the test
# deterministic, and a distribution that ignores a setting lands far beyond them.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])


def _filtered_softmax(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The reference in float64, token by token: temperature, then the k best, then the smallest
    nucleus >= top_p."""
    probs = (LOGITS.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    kept_probs = probs[kept] / probs[kept].sum()
    nucleus, mass = [], 0.0
    for token, p in zip(kept, kept_probs.tolist()):
        if mass >= top_p:
            break
        nucleus.append(token)
        mass += p
    expected = torch.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return expected


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.7, 5, 0.9), (1.5, 6, 0.8),
])
def test_sampled_frequencies_fit_the_filtered_softmax(temperature, top_k, top_p):
    """A chi-square goodness-of-fit test over 4,000 draws against the float64 reference: fails if temperature,
    top-k or top-p were ignored or applied in another order."""
    expected = _filtered_softmax(temperature, top_k, top_p)
    draws = 4_000
    picks = sample(LOGITS.expand(draws, -1),
                   SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                   torch.Generator().manual_seed(0))
    counts = torch.bincount(picks, minlength=len(LOGITS)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token the filters remove"
    expected_counts = expected[support] * draws
    chi2 = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts.tolist(), expected_counts.tolist())
