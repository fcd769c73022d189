"""Step jitter: the spread and the persistence of real step times, measured from a
profile's samples and drawn again for simulated steps."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from servelab.plugins.cost_model.step_jitter import (StepJitter, dispersion_quantiles, fit_persistence,
                                                     lag_correlations, normal_scores)

QUANTILES = [0.8 + 0.4 * k / 100 for k in range(101)]


def test_dispersion_is_the_spread_of_repeats_around_their_medians():
    quantiles = dispersion_quantiles([[1.0, 2.0, 3.0], [10.0, 10.0, 40.0]])
    # ratios: 0.5, 1, 1.5 and 1, 1, 4
    assert len(quantiles) == 101 and quantiles[0] == 0.5 and quantiles[-1] == 4.0 and quantiles[50] == 1.0
    draws = [StepJitter(quantiles, seed=3).factor() for _ in range(2)]
    assert draws[0] == draws[1]                              # seeded
    jitter = StepJitter(quantiles, seed=3)
    factors = [jitter.factor() for _ in range(20000)]
    assert 0.5 <= min(factors) and max(factors) <= 4.0
    # the mean of the piecewise-linear quantile function
    expected = sum((a + b) / 2 for a, b in zip(quantiles, quantiles[1:])) / 100
    assert sum(factors) / len(factors) == pytest.approx(expected, rel=0.03)
    with pytest.raises(ValueError, match="non-decreasing"):
        StepJitter([1.2, 1.0], seed=0)
    with pytest.raises(ValueError, match="persistence"):
        StepJitter(QUANTILES, seed=0, persistence=[(0.5, 0.0)])
    with pytest.raises(ValueError, match="persistence"):
        StepJitter(QUANTILES, seed=0, persistence=[(0.7, 1.0), (0.7, 10.0)])


def test_normal_scores_follow_the_ranks():
    scores = normal_scores([3.0, 1.0, 2.0, 2.0])
    assert scores[1] < scores[2] == scores[3] < scores[0] and sum(scores) == pytest.approx(0.0, abs=1e-9)


def drifting_samples(persistence, steps: int = 40, repeats: int = 12, gap: float = 0.05):
    """Samples as a profile takes them (shuffled passes over ``steps`` steps, ``gap`` s
    apart), each time a median times exp(0.1 * score), the scores drawn by ``StepJitter``'s
    process with that persistence (its factors are the scores' normal quantiles)."""
    rng = random.Random(0)
    jitter = StepJitter([0.5, 1.5], seed=1, persistence=persistence)
    now, samples = 0.0, []
    for _ in range(repeats):
        order = list(range(steps))
        rng.shuffle(order)
        for step in order:
            score = (jitter.factor(now) - 1.0) * 2                # uniform in [-1, 1], a monotone map of the score
            samples.append((now, step, (1 + step) * math.exp(0.1 * score)))
            now += gap
    medians = {s: statistics.median(t for _, i, t in samples if i == s) for s in range(steps)}
    return [(start, step, seconds / medians[step]) for start, step, seconds in samples]


def test_persistence_is_recovered_from_a_profiles_samples():
    [(share, tau)] = fit_persistence(lag_correlations(drifting_samples([(0.6, 2.0)])))
    assert share == pytest.approx(0.6, abs=0.15) and tau == pytest.approx(2.0, rel=0.5)
    fast, slow = fit_persistence(lag_correlations(drifting_samples([(0.4, 0.15), (0.4, 5.0)])))
    assert fast[1] < 0.6 < 2.0 < slow[1] and fast[0] + slow[0] == pytest.approx(0.8, abs=0.2)
    independent = lag_correlations(drifting_samples([]))
    assert all(sum(share * math.exp(-dt / tau) for share, tau in fit_persistence(independent)) < 0.05
               for dt, _, _ in independent)                  # no persistence at any measured separation
    assert fit_persistence([]) == [] and lag_correlations([(0.0, 0, 1.0)] * 3) == []


def test_persistent_jitter_keeps_the_spread_and_correlates_nearby_steps():
    def lag1_correlation(factors):
        a, b = factors[:-1], factors[1:]
        return statistics.correlation(a, b)

    independent = StepJitter(QUANTILES, seed=5)
    persistent = StepJitter(QUANTILES, seed=5, persistence=[(0.8, 1.0)])
    steps = [0.01 * i for i in range(20000)]              # 10 ms apart: 100 steps per correlation time
    free = [independent.factor(t) for t in steps]
    drifting = [persistent.factor(t) for t in steps]
    assert abs(lag1_correlation(free)) < 0.05 and lag1_correlation(drifting) > 0.6
    for factors in (free, drifting):                        # the measured spread either way
        assert min(factors) >= 0.8 and max(factors) <= 1.2
        assert statistics.mean(factors) == pytest.approx(1.0, abs=0.02)
    far_apart = StepJitter(QUANTILES, seed=5, persistence=[(0.3, 0.05), (0.5, 1.0)])
    assert abs(lag1_correlation([far_apart.factor(10.0 * i) for i in range(5000)])) < 0.05
