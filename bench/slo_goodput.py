"""Goodput at an SLO attainment target from a rate sweep, as DistServe and Splitwise
measure it: the highest request rate at which a share (90%) of requests meets every
latency objective, read off each setup's attainment-against-rate curve."""

from __future__ import annotations

from typing import Any, Iterable

from servelab.bench.paper_report import job_config


def setup_name(row: dict[str, Any], group: str) -> str:
    """The option of config group ``group`` a sweep job ran (``+<group>=<option>``)."""
    prefix = f"+{group}="
    return next(o[len(prefix):] for o in row["job"]["overrides"] if o.startswith(prefix))


def devices(row: dict[str, Any]) -> dict[str, int]:
    """Devices a job used, by hardware name: every instance of both pools of a
    disaggregated run, else the one engine's (or each replica's) split."""
    pools = row["system"].get("pools")
    used: dict[str, int] = {}
    if pools:
        for pool in pools.values():
            count = pool["instances"] * pool["tensor_parallel_size"] * pool["pipeline_parallel_size"]
            used[pool["hardware"]] = used.get(pool["hardware"], 0) + count
        return used
    cfg = job_config(row)
    count = cfg.parallel.tensor_parallel_size * cfg.parallel.pipeline_parallel_size * cfg.target.replicas
    return {cfg.hardware.name: count}


def curve(rows: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(rate, SLO attainment)`` of a setup's jobs, by rate."""
    return sorted((row["workload"]["rate"], row["slo_attainment"] or 0.0) for row in rows)


def rate_at_attainment(points: list[tuple[float, float]], target: float = 0.9) -> tuple[float | None, str]:
    """The rate where attainment falls to ``target``, interpolated linearly between the
    last swept rate meeting it and the next; with how it was bounded: ``""`` (found),
    ``">="`` (every rate met it: the highest) or ``"<"`` (none did: the lowest)."""
    if not points:
        return None, ""
    if points[0][1] < target:
        return points[0][0], "<"
    for (low, a_low), (high, a_high) in zip(points, points[1:]):
        if a_high < target:
            return low + (high - low) * (a_low - target) / (a_low - a_high), ""
    return points[-1][0], ">="


def cell(value: float | None, bound: str) -> str:
    """A rate with its bound mark, 3 significant digits."""
    return "-" if value is None else f"{bound + ' ' if bound else ''}{value:.3g}"
