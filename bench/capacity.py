"""Capacity: the highest request rate whose P99 time between tokens meets the SLO
(Sarathi-Serve's definition), found by a bounded bisection."""

from __future__ import annotations

import math
from typing import Any, Callable

from servelab.core.errors import ConfigError


def search_capacity(measure: Callable[[float], float], slo_ms: float, rate_low: float, rate_high: float,
                    max_iterations: int, tolerance: float) -> dict[str, Any]:
    """Bisect the rate in [``rate_low``, ``rate_high``] requests/s.

    ``measure(rate)`` runs the workload at ``rate`` and returns its P99 TBT in ms (NaN
    fails). The ends are tried first: if ``rate_low`` already misses the SLO the capacity
    is 0 (below the range); if ``rate_high`` meets it, ``rate_high`` is a lower bound.
    Otherwise the geometric midpoint of the bracket is tried until ``max_iterations`` runs
    were made or high/low - 1 < ``tolerance``. Returns ``capacity_rps`` (the highest rate
    that met the SLO), the final bracket, whether the search hit a range end, and every trial.
    """
    if not 0 < rate_low < rate_high:
        raise ConfigError([f"mode.rate_low and mode.rate_high must satisfy 0 < low < high, got {rate_low}, {rate_high}"])
    if max_iterations < 2:
        raise ConfigError([f"mode.max_iterations must be >= 2 (both ends are tried), got {max_iterations}"])
    trials: list[dict[str, Any]] = []

    def meets(rate: float) -> bool:
        p99 = measure(rate)
        ok = not math.isnan(p99) and p99 <= slo_ms
        trials.append({"rate": rate, "tbt_p99_ms": p99, "meets_slo": ok})
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
    """``mode=capacity``: search the rate with ``cfg.mode``'s bounds and
    ``cfg.slo.tbt_p99_ms``; returns the metrics of the run at the capacity (or at
    ``rate_low`` when even that misses) plus ``capacity`` (the search result). Arrivals
    are Poisson at the rate tried (gamma when ``workload.arrival=gamma``)."""
    import copy

    from servelab.bench.runner import measure

    slo_ms = cfg.slo.tbt_p99_ms
    if slo_ms is None:
        raise ConfigError(["mode=capacity needs slo.tbt_p99_ms (the P99 time-between-tokens objective, ms)"])
    cfg = copy.deepcopy(cfg)
    if cfg.workload.arrival == "all_at_once":
        cfg.workload.arrival = "poisson"
    runs: dict[float, dict[str, Any]] = {}

    def p99_tbt(rate: float) -> float:
        runs[rate] = measure(system, cfg, rate=rate, desc=f"rate {rate:.3g}/s")
        p99 = runs[rate]["itl_ms"]["p99"]
        print(f"capacity: {rate:.3g} req/s -> P99 TBT {p99 if p99 is None else round(p99, 2)} ms "
              f"(SLO {slo_ms} ms)", flush=True)
        return math.nan if p99 is None else p99

    mode = cfg.mode
    found = search_capacity(p99_tbt, slo_ms, mode.rate_low, mode.rate_high, mode.max_iterations, mode.tolerance)
    metrics = runs[found["capacity_rps"] or mode.rate_low]
    metrics["capacity"] = {"slo_tbt_p99_ms": slo_ms, **found}
    return metrics
