"""How much a real step's time strays from its median, and for how long.

A step repeated on a real machine never takes the same time twice, and the machine's speed
drifts: a step that runs slow is often followed by more slow steps (another tenant, clock
frequency, cache and memory traffic). Near saturation both set the tails (P90 TTFT, P99
TPOT): a run of slow steps builds a queue that independent draws of the same spread do not.

``servelab-bench mode=profile`` records both in a step table's ``meta.dispersion``:

- ``step_time_over_median``: quantiles of (one repeat's time / that step's median) over
  every measured step and repeat (``dispersion_quantiles``): how far steps stray;
- ``persistence``: how those strays persist in time (``fit_persistence``). The profile
  times its steps in a shuffled order, so consecutive samples are different steps; the
  normal scores of their ratios are correlated pair by pair, binned by the time between
  them (``lag_correlations``, kept in the table too), and fitted as a sum of at most two
  terms ``share * exp(-dt / correlation_time_s)``: each share of the variance is a drift
  that decorrelates over its time (a fast one over tens of milliseconds, a slow one over
  seconds, as this CPU shows), the rest changes from step to step.

``StepJitter`` draws the factor of each simulated step at its start time on the virtual
clock: a Gaussian process with that correlation, mapped through the quantiles, so every
step's factor follows the measured spread and consecutive steps share the drift.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from statistics import NormalDist

DISPERSION_QUANTILES = 101
"""How many evenly spaced quantiles (0 to 1) of the step-time ratio a profile records."""

_NORMAL = NormalDist()


def dispersion_quantiles(repeats: Sequence[Sequence[float]]) -> list[float]:
    """Quantiles of each repeat's time over its step's median, pooled over all steps."""
    ratios = sorted(t / statistics.median(times) for times in repeats if times for t in times)
    if not ratios:
        return []
    last = len(ratios) - 1
    out = []
    for k in range(DISPERSION_QUANTILES):
        position = k * last / (DISPERSION_QUANTILES - 1)
        below = int(position)
        above = min(below + 1, last)
        out.append(round(ratios[below] + (ratios[above] - ratios[below]) * (position - below), 6))
    return out


def normal_scores(values: Sequence[float]) -> list[float]:
    """Each value's rank mapped to the standard normal quantile (ties share a mean rank)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return [_NORMAL.inv_cdf((r + 0.5) / len(values)) for r in ranks]


def lag_correlations(samples: Sequence[tuple[float, int, float]], bins: int = 12) -> list[tuple[float, float, int]]:
    """Correlation of the ratios' normal scores between samples of different steps, by the
    time between them: ``samples`` are (start seconds, step index, time / step median);
    returns (mean seconds apart, correlation, pairs) per log-spaced bin of separations from
    the shortest gap between samples to half the span."""
    if len(samples) < 8:
        return []
    samples = sorted(samples)
    scores = normal_scores([ratio for _, _, ratio in samples])
    gaps = [b[0] - a[0] for a, b in zip(samples, samples[1:]) if b[0] > a[0]]
    low, high = min(gaps, default=0.0), (samples[-1][0] - samples[0][0]) / 2
    if low <= 0 or high <= low:
        return []
    edges = [low * (high / low) ** (k / bins) for k in range(bins + 1)]
    sums = [[0.0, 0.0, 0] for _ in range(bins)]  # seconds, score products, pairs
    for i, (start, step, _) in enumerate(samples):
        for j in range(i + 1, len(samples)):
            apart = samples[j][0] - start
            if apart >= high:
                break
            if samples[j][1] == step or apart < low:
                continue
            k = min(int(math.log(apart / low) / math.log(high / low) * bins), bins - 1)
            sums[k][0] += apart
            sums[k][1] += scores[i] * scores[j]
            sums[k][2] += 1
    return [(seconds / pairs, products / pairs, pairs) for seconds, products, pairs in sums if pairs >= 20]


PERSISTENCE_TIMES = tuple(1e-3 * 10 ** (k / 8) for k in range(49))
"""Candidate correlation times of ``fit_persistence``: 1 ms to 1000 s, 8 per decade (those
within a factor 2 of the measured separations)."""


def fit_persistence(correlations: Sequence[tuple[float, float, int]]) -> list[tuple[float, float]]:
    """``[(share, correlation_time_s), ...]``: at most two components whose sum
    ``share * exp(-seconds / correlation_time_s)`` fits ``lag_correlations`` best (least
    squares, every bin weighted alike: the pairs of a bin are not independent samples;
    shares positive and at most 1 together); empty when the strays do not persist."""
    if not correlations:
        return []
    shortest = min(dt for dt, _, _ in correlations)
    longest = max(dt for dt, _, _ in correlations)
    candidates = [tau for tau in PERSISTENCE_TIMES if shortest / 2 <= tau <= 2 * longest]
    best: tuple[float, list[tuple[float, float]]] = (sum(rho * rho for _, rho, _ in correlations), [])
    for i, short in enumerate(candidates):
        for long in (None, *candidates[i + 1:]):
            times = (short,) if long is None else (short, long)
            shares = _nonnegative_shares(correlations, times)
            if shares is None:
                continue
            error = sum((rho - sum(a * math.exp(-dt / tau) for a, tau in zip(shares, times))) ** 2
                        for dt, rho, _ in correlations)
            if error < best[0] - 1e-12:
                best = (error, [(round(a, 4), round(tau, 4)) for a, tau in zip(shares, times) if a > 0])
    return best[1]


def _nonnegative_shares(correlations: Sequence[tuple[float, float, int]], times: tuple[float, ...]
                        ) -> tuple[float, ...] | None:
    """The least-squares shares of the components with ``times`` (None unless all come out
    positive), scaled down to sum to at most 1."""
    columns = [[math.exp(-dt / tau) for dt, _, _ in correlations] for tau in times]
    target = [rho for _, rho, _ in correlations]
    gram = [[sum(x * y for x, y in zip(a, b)) for b in columns] for a in columns]
    moment = [sum(x * t for x, t in zip(a, target)) for a in columns]
    if len(times) == 1:
        shares = (moment[0] / gram[0][0],) if gram[0][0] > 0 else (0.0,)
    else:
        determinant = gram[0][0] * gram[1][1] - gram[0][1] * gram[1][0]
        if abs(determinant) < 1e-12:
            return None
        shares = ((moment[0] * gram[1][1] - moment[1] * gram[0][1]) / determinant,
                  (moment[1] * gram[0][0] - moment[0] * gram[1][0]) / determinant)
    if min(shares) <= 0:
        return None
    total = sum(shares)
    return shares if total <= 1 else tuple(a / total for a in shares)


class StepJitter:
    """Seeded per-step time factors with the profile's spread (``quantiles``, linear between
    them) and persistence: the normal score behind each draw is the sum of one drift per
    ``persistence`` component ``(share, correlation_time_s)``, each decorrelating over its
    time on the clock and weighted by the root of its share, plus an independent part; no
    components draws every step independently."""

    def __init__(self, quantiles: Sequence[float], seed: int, persistence: Sequence[Sequence[float]] = ()):
        if len(quantiles) < 2 or any(b < a for a, b in zip(quantiles, quantiles[1:])) or quantiles[0] <= 0:
            raise ValueError(f"dispersion quantiles must be positive and non-decreasing, got {list(quantiles)[:5]}...")
        components = [(float(share), float(tau)) for share, tau in persistence]
        if any(share < 0 or tau <= 0 for share, tau in components) or sum(a for a, _ in components) > 1 + 1e-6:
            raise ValueError(f"persistence must be (share, correlation_time_s) pairs with shares >= 0 summing to "
                             f"at most 1 and positive times, got {components}")
        self.quantiles = tuple(quantiles)
        self.components = components
        self.independent_share = max(1.0 - sum(share for share, _ in components), 0.0)
        self.rng = random.Random(seed)
        self.drifts = [self.rng.gauss(0.0, 1.0) for _ in components]
        self.last_s: float | None = None

    def factor(self, now_s: float = 0.0) -> float:
        """The factor on the median time of the step that starts at ``now_s``."""
        score = math.sqrt(self.independent_share) * self.rng.gauss(0.0, 1.0)
        apart = 0.0 if self.last_s is None else max(now_s - self.last_s, 0.0)
        self.last_s = now_s
        for k, (share, tau) in enumerate(self.components):
            kept = math.exp(-apart / tau)
            self.drifts[k] = kept * self.drifts[k] + math.sqrt(1 - kept * kept) * self.rng.gauss(0.0, 1.0)
            score += math.sqrt(share) * self.drifts[k]
        position = _NORMAL.cdf(score) * (len(self.quantiles) - 1)
        below = min(int(position), len(self.quantiles) - 2)
        low, high = self.quantiles[below], self.quantiles[below + 1]
        return low + (high - low) * (position - below)
