"""Metrics of a multi-tenant run: each tenant's service and latency, Jain's fairness index
over the tenants' service rates, and attainment of each request's SLO class.

Service is VTC's measure (Sheng et al., OSDI'24): ``INPUT_WEIGHT`` per prompt token (counted
when its first token arrives) plus ``OUTPUT_WEIGHT`` per generated token (when it arrives).
It is counted over the *load window*, from the first arrival while every tenant is still
sending: once arrivals stop, every queued request is eventually served, so service over
the whole run only restates what each tenant sent.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Mapping, Sequence

from servelab.bench.metrics import RequestRecord, distribution_ms
from servelab.core.policy import SLOClass

INPUT_WEIGHT = 1
"""Service per prompt token (VTC's w_p)."""
OUTPUT_WEIGHT = 2
"""Service per generated token (VTC's w_q)."""
TIMELINE_BUCKETS = 10
"""How many equal intervals of the load window ``fairness.timeline`` reports."""


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one
    takes everything; None for no values or all zero."""
    square_sum = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * square_sum) if square_sum > 0 else None


def service_until(record: RequestRecord, until: float) -> float:
    """Weighted tokens ``record`` received by time ``until`` (prompt with its first token)."""
    times = record.token_times
    if not times or times[0] > until:
        return 0.0
    return INPUT_WEIGHT * record.num_prompt_tokens + OUTPUT_WEIGHT * bisect_right(times, until)


def load_window(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """(start, end) of the load window: first arrival to the earliest of the tenants' last
    arrivals (while every tenant still sends), or to the last token when every request
    arrived at once."""
    start = min((r.arrival_time for r in records), default=0.0)
    last: dict[str | None, float] = {}
    for record in records:
        last[record.tenant] = max(last.get(record.tenant, start), record.arrival_time)
    end = min(last.values(), default=start)
    if end <= start:
        end = max((r.token_times[-1] for r in records if r.token_times), default=start)
    return start, end


def tenant_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Per tenant (``tenants``): requests sent and refused, output and service tokens/s in
    the load window, TTFT and TPOT distributions (ms); and ``fairness``: the window,
    Jain's index over the service rates, their max - min, and each tenant's service per
    ``TIMELINE_BUCKETS`` interval of the window (tokens/s)."""
    start, end = load_window(records)
    span = end - start
    by_tenant: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_tenant.setdefault(record.tenant or "default", []).append(record)
    tenants, rates, timeline = {}, {}, {}
    edges = [start + span * (i + 1) / TIMELINE_BUCKETS for i in range(TIMELINE_BUCKETS)]
    for name, mine in sorted(by_tenant.items()):
        done = [r for r in mine if r.ok]
        service = sum(service_until(r, end) for r in done)
        outputs = sum(bisect_right(r.token_times, end) for r in done)
        rates[name] = service / span if span > 0 else None
        totals = [0.0] + [sum(service_until(r, edge) for r in done) for edge in edges]
        timeline[name] = [(b - a) / (span / TIMELINE_BUCKETS) for a, b in zip(totals, totals[1:])] if span > 0 else []
        tenants[name] = {
            "requests": len(mine), "completed": len(done),
            "refused": sum(r.finish_reason == "deadline" for r in mine),
            "priority": mine[0].priority, "slo_class": mine[0].slo_class,
            "output_tokens_per_s": outputs / span if span > 0 else None,
            "service_tokens_per_s": rates[name],
            "ttft_ms": distribution_ms([r.ttft for r in done]),
            "tpot_ms": distribution_ms([t for r in done if (t := r.tpot) is not None]),
        }
    known = [rate for rate in rates.values() if rate is not None]
    fairness = {"window_s": span, "jain": jain_index(known),
                "service_difference_per_s": max(known) - min(known) if known else None,
                "timeline_bucket_s": span / TIMELINE_BUCKETS, "timeline": timeline}
    return {"tenants": tenants, "fairness": fairness}


def slo_class_summary(records: Sequence[RequestRecord], classes: Mapping[str, SLOClass],
                      duration: float) -> dict[str, Any]:
    """Per SLO class (``slo_classes``): requests, those meeting the class (TTFT and mean
    TPOT within its targets; refused or failed requests, and classes not in
    ``classes``, miss it), attainment and goodput
    (met per second of the run); ``slo_class_attainment`` and ``slo_class_goodput`` over
    every request that names a class."""
    per_class: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.slo_class is None:
            continue
        entry = per_class.setdefault(record.slo_class, {"requests": 0, "met": 0})
        entry["requests"] += 1
        slo = classes.get(record.slo_class)
        entry["met"] += record.ok and slo is not None and slo.attained(record.ttft, record.tpot)
    for entry in per_class.values():
        entry["attainment"] = entry["met"] / entry["requests"]
        entry["goodput"] = entry["met"] / duration if duration > 0 else None
    requests = sum(e["requests"] for e in per_class.values())
    met = sum(e["met"] for e in per_class.values())
    return {"slo_classes": per_class,
            "slo_class_attainment": met / requests if requests else None,
            "slo_class_goodput": met / duration if requests and duration > 0 else None}
