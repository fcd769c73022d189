"""Tables of benchmark metrics: the summary printed after a run, the sweep's markdown, and
the markdown rows every script in ``benchmarks/`` prints."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence


def metric_value(metrics: dict[str, Any], *path: str) -> Any:
    """``metrics[path[0]][path[1]]...``; None where a key is missing."""
    value: Any = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _get(*path: str) -> Callable[[dict[str, Any]], Any]:
    return lambda metrics: metric_value(metrics, *path)


def _percent(*path: str) -> Callable[[dict[str, Any]], Any]:
    read = _get(*path)
    return lambda metrics: None if read(metrics) is None else 100 * read(metrics)


COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = (
    ("system", _get("system", "name")),
    ("rate req/s", _get("workload", "rate")),
    ("req/s", _get("request_throughput")),
    ("out tok/s", _get("output_throughput")),
    ("TTFT mean ms", _get("ttft_ms", "mean")),
    ("TTFT p50 ms", _get("ttft_ms", "p50")),
    ("TTFT p99 ms", _get("ttft_ms", "p99")),
    ("TPOT mean ms", _get("tpot_ms", "mean")),
    ("TPOT p99 ms", _get("tpot_ms", "p99")),
    ("ITL p50 ms", _get("itl_ms", "p50")),
    ("ITL p90 ms", _get("itl_ms", "p90")),
    ("ITL p99 ms", _get("itl_ms", "p99")),
    ("E2E p50 ms", _get("e2e_ms", "p50")),
    ("E2E p99 ms", _get("e2e_ms", "p99")),
    ("goodput req/s", _get("goodput")),
    ("SLO met %", _percent("slo_attainment")),
    ("class SLO met %", _percent("slo_class_attainment")),
    ("class goodput req/s", _get("slo_class_goodput")),
    ("Jain", _get("fairness", "jain")),
    ("service diff tok/s", _get("fairness", "service_difference_per_s")),
    ("KV waste %", _percent("system", "kv_waste")),
    ("KV peak reserved", _get("system", "kv_peak_reserved_slots")),
    ("peak running", _get("system", "peak_running")),
    ("expert imbalance", _get("system", "experts", "imbalance")),
    ("adapter hit %", _percent("system", "lora", "hit_rate")),
    ("adapter load ms", _get("system", "lora", "load_ms")),
    ("preemptions", _get("preemptions")),
    ("prefix hit %", _percent("prefix_cache_hit_rate")),
    ("later TTFT p50 ms", _get("sessions", "later_turns", "ttft_ms", "p50")),
    ("later TTFT p99 ms", _get("sessions", "later_turns", "ttft_ms", "p99")),
    ("later prefix hit %", _percent("sessions", "later_turns", "prefix_cache_hit_rate")),
    ("spec accept %", _percent("spec_acceptance_rate")),
    ("accepted length", _get("system", "spec_accepted_length")),
    ("capacity req/s", _get("capacity", "capacity_rps")),
    ("failed", _get("num_failed")),
)
"""Columns of the tables: a header and how to read it from a job's metrics."""


def format_value(value: Any) -> str:
    """Numbers with 3 significant digits (integers as they are); missing values as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (bool, int, str)):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _present(rows: Sequence[dict[str, Any]]) -> list[tuple[str, Callable[[dict[str, Any]], Any]]]:
    return [(name, read) for name, read in COLUMNS if any(read(row) is not None for row in rows)]


TENANT_HEADER = ("tenant", "requests", "refused", "out tok/s", "service tok/s", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms")
"""Columns of the per-tenant table (service = prompt + 2 x output tokens, in the load window)."""


def tenant_rows(metrics: dict[str, Any]) -> list[list[Any]]:
    """One row per tenant of a run's ``tenants`` metrics (``TENANT_HEADER``'s columns)."""
    return [[name, t["requests"], t["refused"], t["output_tokens_per_s"], t["service_tokens_per_s"],
             t["ttft_ms"]["p50"], t["ttft_ms"]["p99"], t["tpot_ms"]["p50"], t["tpot_ms"]["p99"]]
            for name, t in metrics.get("tenants", {}).items()]


def summary_table(metrics: dict[str, Any]) -> str:
    """A two-column table of one run's headline metrics (rows without a value omitted),
    then one row per tenant and per SLO class when the workload has tenants."""
    lines = [f"{name:>18}  {format_value(read(metrics))}" for name, read in _present([metrics])]
    lines.insert(0, f"{'requests':>18}  {metrics['num_completed']}/{metrics['num_requests']} in "
                    f"{format_value(metrics['duration_s'])} s")
    if metrics.get("tenants"):
        lines += ["", render_markdown(TENANT_HEADER, tenant_rows(metrics), "l" + "r" * (len(TENANT_HEADER) - 1))]
    if metrics.get("slo_classes"):
        lines += [render_markdown(["SLO class", "requests", "met", "attainment %", "goodput req/s"],
                                  [[name, c["requests"], c["met"], 100 * c["attainment"], c["goodput"]]
                                   for name, c in metrics["slo_classes"].items()], "lrrrr")]
    return "\n".join(lines)


def markdown_row(cells: Sequence[Any]) -> str:
    """One markdown table row of ``cells`` (strings as they are, other values through
    ``format_value``)."""
    return "| " + " | ".join(c if isinstance(c, str) else format_value(c) for c in cells) + " |"


def markdown_header(header: Sequence[str], align: str | None = None) -> str:
    """A markdown table's header and separator lines. ``align`` has one letter per column,
    ``l`` (``---``) or ``r`` (``---:``, numbers); None leaves every column unaligned."""
    marks = ["---:" if a == "r" else "---" for a in (align or "l" * len(header))]
    if len(marks) != len(header):
        raise ValueError(f"align has {len(marks)} letters for {len(header)} columns")
    return markdown_row(list(header)) + "\n|" + "|".join(marks) + "|"


def render_markdown(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A whole markdown table: ``markdown_header`` and one ``markdown_row`` per row."""
    return "\n".join([markdown_header(header, align), *(markdown_row(row) for row in rows)]) + "\n"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One markdown row per job (``job.label`` first), with the columns any job has."""
    columns = _present(rows)
    header = ["job"] + [name for name, _ in columns]
    return render_markdown(header, [[str(metric_value(row, "job", "label") or "")] +
                                    [format_value(read(row)) for _, read in columns] for row in rows])
