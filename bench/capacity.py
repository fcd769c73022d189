"""Capacity: the highest request rate whose P99 time between tokens meets the SLO, and
whose median scheduling delay meets its own when one is set (Sarathi-Serve's definition),
or whose normalized latency does (PagedAttention's sustained rate), found by a bounded
bisection."""

from __future__ import annotations

import math
from typing import Any, Callable

from servelab.core.errors import ConfigError

OBJECTIVES = {"tbt_p99_ms": ("itl_ms", "p99"), "scheduling_delay_p50_ms": ("scheduling_delay_ms", "p50"),
              "normalized_latency_ms": ("normalized_latency_ms",)}
"""Capacity objectives (``slo.<name>``) and the metric each bounds."""


def search_capacity(measure: Callable[[float], dict[str, float]], objectives: dict[str, float], rate_low: float,
                    rate_high: float, max_iterations: int, tolerance: float) -> dict[str, Any]:
    """Bisect the rate in [``rate_low``, ``rate_high``] requests/s.

    ``measure(rate)`` runs the workload at ``rate`` and returns the value (ms) of every
    objective named in ``objectives`` (objective name -> limit); a rate meets the SLO when
    every value is at most its limit (NaN fails). The ends are tried first: if
    ``rate_low`` already misses the SLO the capacity is 0 (below the range); if
    ``rate_high`` meets it, ``rate_high`` is a lower bound. Otherwise the geometric
    midpoint of the bracket is tried until ``max_iterations`` runs were made or
    high/low - 1 < ``tolerance``. Returns ``capacity_rps`` (the highest rate that met the
    SLO), the final bracket, whether the search hit a range end, and every trial.
    """
    if not 0 < rate_low < rate_high:
        raise ConfigError([f"mode.rate_low and mode.rate_high must satisfy 0 < low < high, got {rate_low}, {rate_high}"])
    if max_iterations < 2:
        raise ConfigError([f"mode.max_iterations must be >= 2 (both ends are tried), got {max_iterations}"])
    trials: list[dict[str, Any]] = []

    def meets(rate: float) -> bool:
        values = measure(rate)
        ok = all(not math.isnan(values[name]) and values[name] <= limit for name, limit in objectives.items())
        trials.append({"rate": rate, **values, "meets_slo": ok})
        return ok

    if not meets(rate_low):
        return {"capacity_rps": 0.0, "bracket": [0.0, rate_low], "limited_by": "rate_low", "trials": trials}
    if meets(rate_high):
        return {"capacity_rps": rate_high, "bracket": [rate_high, math.inf], "limited_by": "rate_high", "trials": trials}
    low, high = rate_low, rate_high
    while len(trials) < max_iterations and high / low - 1 >= tolerance:
        mid = math.sqrt(low * high)
        if meets(mid):
            low = mid
        else:
            high = mid
    return {"capacity_rps": low, "bracket": [low, high], "limited_by": None, "trials": trials}


def measure_capacity(system: Any, cfg: Any) -> dict[str, Any]:
    """``mode=capacity``: search the rate with ``cfg.mode``'s bounds against every
    objective of ``OBJECTIVES`` set in ``cfg.slo`` (at least one); returns the
    metrics of the run at the capacity (or at ``rate_low`` when even that misses) plus
    ``capacity`` (the objectives and the search result). Arrivals are Poisson at the rate
    tried (gamma when ``workload.arrival=gamma``)."""
    import copy

    from servelab.bench.report import metric_value
    from servelab.bench.runner import measure

    objectives = {name: cfg.slo[name] for name in OBJECTIVES if cfg.slo[name] is not None}
    if not objectives:
        raise ConfigError(["mode=capacity needs slo.tbt_p99_ms (the P99 time-between-tokens objective, ms) or "
                           "slo.normalized_latency_ms (the mean end-to-end latency per output token, ms)"])
    cfg = copy.deepcopy(cfg)
    if cfg.workload.arrival == "all_at_once":
        cfg.workload.arrival = "poisson"
    runs: dict[float, dict[str, Any]] = {}

    def values(rate: float) -> dict[str, float]:
        runs[rate] = measure(system, cfg, rate=rate, desc=f"rate {rate:.3g}/s")
        found = {name: metric_value(runs[rate], *OBJECTIVES[name]) for name in objectives}
        found = {name: math.nan if value is None else value for name, value in found.items()}
        print(f"capacity: {rate:.3g} req/s -> " + ", ".join(
            f"{name} {value:.4g} (SLO {objectives[name]})" for name, value in found.items()), flush=True)
        return found

    mode = cfg.mode
    found = search_capacity(values, objectives, mode.rate_low, mode.rate_high, mode.max_iterations, mode.tolerance)
    metrics = runs[found["capacity_rps"] or mode.rate_low]
    metrics["capacity"] = {**{f"slo_{name}": cfg.slo[name] for name in OBJECTIVES}, **found}
    return metrics
