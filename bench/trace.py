"""Request traces: arrival times and prompt/output lengths recorded from real traffic.

A trace is a CSV file with one request per row and the columns ``arrived_at`` (seconds),
``num_prefill_tokens`` (prompt length) and ``num_decode_tokens`` (output length), the
format of the production traces shipped in ``bench/traces/`` (``workload=conversation``,
``workload=code``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib.resources import files

from servelab.core.errors import ConfigError

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One recorded request: when it arrived (seconds) and its prompt and output lengths."""

    arrived_at: float
    prompt_tokens: int
    output_tokens: int


def shipped_trace(name: str) -> str:
    """The path of a trace shipped with servelab (``${servelab_trace:conversation}``)."""
    return str(files("servelab.bench").joinpath("traces", f"{name}.csv"))


def read_trace(path: str | None, num_requests: int) -> list[TraceRequest]:
    """The first ``num_requests`` requests of the trace at ``path``, by arrival time."""
    if not path:
        raise ConfigError(["workload.path is not set: a trace workload reads a CSV file (workload=trace "
                           "workload.path=...), or use workload=conversation / workload=code"])
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise ConfigError([f"workload.path={path!r} has no column {', '.join(missing)} "
                                   f"(a trace needs {', '.join(COLUMNS)})"])
            rows = [TraceRequest(float(r["arrived_at"]), int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                    for r in reader]
    except OSError as exc:
        raise ConfigError([f"workload.path={path!r} cannot be read: {exc}"]) from exc
    except ValueError as exc:
        raise ConfigError([f"workload.path={path!r} has a row that is not numbers: {exc}"]) from exc
    rows.sort(key=lambda r: r.arrived_at)
    if len(rows) < num_requests:
        raise ConfigError([f"workload.num_requests={num_requests} but the trace {path!r} holds {len(rows)} requests"])
    return rows[:num_requests]


def trace_offsets(rows: list[TraceRequest], rate: float | None) -> list[float]:
    """Arrival offsets from the first request: as recorded, or rescaled in time so that
    the mean rate is ``rate`` requests/s (for rate sweeps and capacity searches)."""
    offsets = [r.arrived_at - rows[0].arrived_at for r in rows]
    if rate is None or len(rows) < 2 or offsets[-1] <= 0:
        return offsets
    if rate <= 0:
        raise ConfigError([f"workload.rate must be > 0 requests/s, got {rate}"])
    scale = (len(rows) - 1) / rate / offsets[-1]
    return [offset * scale for offset in offsets]
