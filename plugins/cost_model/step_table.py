"""Whole-step tables (``kind: steps``): a model measured step by step on one machine.

``servelab-bench mode=profile`` times the engine's real forward pass over a grid of
steps (prefills, decode batches at several context lengths, prefill chunks over a cached
context, several prompts at once, decodes mixed with a chunk) and the engine's host time
around it. A step's time is modelled as

    linear(padded tokens) + attention_prefill_pair x query-key pairs of requests with
    several new tokens + attention_decode_token x context tokens of decoding requests +
    request x requests + logits_row x sampled rows + engine_overhead(requests)

``linear`` (a series over the number of new tokens, rounded up to the row buckets the CPU
matmuls pad to, ``meta.row_buckets``) holds the token-parallel work and the fixed cost of
a step; the four scalars are seconds per unit; all five are the least-squares fit (relative
error) of the measured steps. ``engine_overhead`` (a series over the requests in the step)
is measured directly: the wall time of ``engine.step()`` outside the executor
(scheduling, stop checks, output rendering). ``linear`` is kept non-decreasing (pooling
adjacent points that dip: more tokens never cost less). ``meta.fit`` reports the model's error on the
measured steps and on held-out random steps.

A step repeated on a real machine does not take the same time twice. ``meta.dispersion``
holds how far and for how long measured steps stray from their medians
(``step_jitter.py``), from which ``StepJitter`` draws a factor for each simulated step, so
queues build behind slow steps as they do in real runs.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from servelab.core.cost_model import BatchShape
from servelab.plugins.cost_model.operators import attended_keys
from servelab.plugins.cost_model.table import CostTable, Series

SCALARS = ("attention_prefill_pair", "attention_decode_token", "request", "logits_row")
"""The per-unit terms of the step model, in the order of ``step_features``' last values."""


def padded_tokens(num_tokens: int, buckets: Sequence[int]) -> int:
    """``num_tokens`` rounded up to the next row bucket (itself past the last bucket)."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else num_tokens


def step_features(batch: BatchShape, buckets: Sequence[int],
                  windows: Sequence[tuple[int | None, int]] = ((None, 1),)) -> tuple[float, ...]:
    """(padded tokens, prefill query-key pairs, decode context tokens, requests, sampled
    rows) of one step; pairs and context tokens are the layers' average over ``windows``,
    (attention window, layers) pairs (``operators.window_groups``; None: the whole context)."""
    layers = sum(count for _, count in windows)
    pairs = decode_context = 0.0
    for window, count in windows:
        share = count / layers
        for q, c in zip(batch.query_lens, batch.context_lens):
            if q == 1:
                decode_context += share * (min(c, window) if window else c)
            elif q > 1:
                pairs += share * attended_keys(q, c, window)
    return (padded_tokens(batch.num_tokens, buckets), float(pairs), float(decode_context),
            float(batch.num_requests), float(batch.num_logits_rows))


def _design_row(features: tuple, grid: Sequence[float]) -> list[float]:
    """Interpolation weights of ``linear`` at the padded token count, then the scalars' units."""
    tokens, *units = features
    weights = [0.0] * len(grid)
    if tokens <= grid[0]:
        weights[0] = 1.0
    elif tokens >= grid[-1]:
        # beyond the grid: the line through the last two points
        span = grid[-1] - grid[-2]
        weights[-1], weights[-2] = 1 + (tokens - grid[-1]) / span, -(tokens - grid[-1]) / span
    else:
        i = bisect.bisect_right(grid, tokens) - 1
        weight = (tokens - grid[i]) / (grid[i + 1] - grid[i])
        weights[i], weights[i + 1] = 1 - weight, weight
    return weights + list(units)


def fit_step_model(batches: Sequence[BatchShape], seconds: Sequence[float], grid: Sequence[int],
                   buckets: Sequence[int]) -> tuple[list[float], dict[str, float]]:
    """Least-squares ``linear`` values on ``grid`` and the four scalars (kept >= 0) that
    best explain ``seconds`` of ``batches`` in relative error."""
    import numpy as np

    rows = np.array([_design_row(step_features(b, buckets), grid) for b in batches])
    target = np.array(seconds)
    scale = 1.0 / target
    active = list(range(rows.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(rows[:, active] * scale[:, None], target * scale, rcond=None)
        negative = [col for col, value in zip(active, solution) if col >= len(grid) and value < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda col: solution[active.index(col)]))
    values = [0.0] * rows.shape[1]
    for col, value in zip(active, solution):
        values[col] = float(value)
    return _non_decreasing([max(v, 0.0) for v in values[:len(grid)]]), dict(zip(SCALARS, values[len(grid):]))


def _non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a step with more
    tokens is never cheaper, so a dip is measurement noise."""
    blocks: list[list[float]] = []  # [sum, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def build_step_series(grid: Sequence[int], linear: Sequence[float], scalars: dict[str, float],
                      overhead_grid: Sequence[int], overhead: Sequence[float]) -> tuple[Series, ...]:
    """The series of a ``steps`` table from a fit and the measured engine overhead."""
    series = [Series("linear", ("num_tokens",), (tuple(float(g) for g in grid),), [round(v, 9) for v in linear])]
    series += [Series(name, (), (), round(scalars[name], 12)) for name in SCALARS]
    series.append(Series("engine_overhead", ("num_requests",), (tuple(float(r) for r in overhead_grid),),
                         [round(v, 9) for v in overhead]))
    return tuple(series)


class StepTableModel:
    """Prices whole steps from a ``steps`` table (see the module docstring)."""

    def __init__(self, table: CostTable, windows: Sequence[tuple[int | None, int]] = ((None, 1),)):
        self.table = table
        self.windows = tuple(windows)
        self.buckets = tuple(table.meta.get("row_buckets") or ())
        self.linear = table.find("linear")
        self.scalars = {name: table.find(name).at() for name in SCALARS}
        self.overhead = table.find("engine_overhead")

    @staticmethod
    def problems(table: CostTable) -> list[str]:
        """What a ``steps`` table lacks."""
        missing = [name for name in ("linear", *SCALARS, "engine_overhead") if table.find(name) is None]
        return [f"cost table {table.path}: no series {', '.join(missing)}"] if missing else []

    def forward_time(self, batch: BatchShape) -> tuple[tuple[str, float], ...]:
        """(part, seconds) of the executor's share of one step."""
        tokens, *units = step_features(batch, self.buckets, self.windows)
        parts = [("linear", self.linear.at(tokens))]
        parts += [(name, self.scalars[name] * unit) for name, unit in zip(SCALARS, units)]
        return tuple(parts)

    def engine_overhead(self, batch: BatchShape) -> float:
        """Host seconds of the step outside the executor."""
        return self.overhead.at(batch.num_requests)


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    """Median and worst |predicted / measured - 1| and the median signed error."""
    errors = sorted(p / m - 1 for p, m in zip(predicted, measured))
    absolute = sorted(abs(e) for e in errors)
    if not errors:
        return {"median": math.nan, "worst": math.nan, "bias": math.nan}
    return {"median": absolute[len(absolute) // 2], "worst": absolute[-1], "bias": errors[len(errors) // 2]}
