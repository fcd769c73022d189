"""Tables of benchmark metrics: the summary printed after a run and the sweep's markdown."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence


def _get(*path: str) -> Callable[[dict[str, Any]], Any]:
    def read(metrics: dict[str, Any]) -> Any:
        value: Any = metrics
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value
    return read


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
    ("KV waste %", _percent("system", "kv_waste")),
    ("KV peak reserved", _get("system", "kv_peak_reserved_slots")),
    ("peak running", _get("system", "peak_running")),
    ("preemptions", _get("preemptions")),
    ("prefix hit %", _percent("prefix_cache_hit_rate")),
    ("spec accept %", _percent("spec_acceptance_rate")),
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


def summary_table(metrics: dict[str, Any]) -> str:
    """A two-column table of one run's headline metrics (rows without a value omitted)."""
    lines = [f"{name:>18}  {format_value(read(metrics))}" for name, read in _present([metrics])]
    lines.insert(0, f"{'requests':>18}  {metrics['num_completed']}/{metrics['num_requests']} in "
                    f"{format_value(metrics['duration_s'])} s")
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One markdown row per job (``job.label`` first), with the columns any job has."""
    columns = _present(rows)
    header = ["job"] + [name for name, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row.get("job", {}).get("label", ""))] + [format_value(read(row)) for _, read in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
