"""servelab's cost table format: measured times as named series on grids, in one JSON file.

One format holds every measurement a cost model interpolates (docs/simulation.md,
"The table format"):

- ``kind: operators``: per-layer operator times of one model shape on one GPU (servelab's
  conversion of Vidur's ``mlp.csv``): series ``<operator>`` where
  ``tensor_parallel_size`` is t, over ``num_tokens``;
- ``kind: collectives``: all-reduce times (Vidur's DGX ``all_reduce.csv``): series
  ``all_reduce`` where ``num_devices`` and ``devices_per_node``, over ``bytes``;
- ``kind: steps``: whole steps of one model on one machine, measured by
  ``servelab-bench mode=profile`` (``step_table.py`` reads them).

A series has zero, one or two ``axes`` with a strictly increasing ``grid`` of points each
and ``seconds`` nested like the grid (a number for zero axes). ``Series.at`` interpolates
linearly between grid points (bilinearly over two axes), holds the first value below the
grid and, above it, extends the line from the grid point nearest half the last one to the
last one (robust to noise in the last points; never downwards).
"""

from __future__ import annotations

import bisect
import importlib.resources
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.core.errors import ConfigError

FORMAT = "servelab-cost-table"
VERSION = 1
KINDS = ("operators", "collectives", "steps")
SHAPE_KEYS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers", "vocab_size",
              "tied_embeddings")
"""``ModelShape`` fields a table may record in ``model``; a model must match every one it
records (a per-layer operator table records no depth or vocabulary)."""


def _segment(grid: tuple[float, ...], x: float) -> tuple[int, float]:
    """Index ``i`` of the segment [grid[i], grid[i+1]] used for ``x`` and its weight on
    ``grid[i+1]``: 0 below the grid, > 1 above it (extrapolation), a single point's 0."""
    if len(grid) == 1 or x <= grid[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(grid, x) - 1, len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def _along(values: list[float], grid: tuple[float, ...], x: float) -> float:
    """Linear interpolation of ``values`` on ``grid`` at ``x`` (see the module docstring)."""
    i, weight = _segment(grid, x)
    if len(grid) == 1:
        return values[0]
    if weight > 1.0:  # above the grid: the line from the point nearest half the last one, never down
        j = min(range(len(grid) - 1), key=lambda k: abs(grid[k] - grid[-1] / 2))
        slope = max(0.0, (values[-1] - values[j]) / (grid[-1] - grid[j]))
        return values[-1] + slope * (x - grid[-1])
    low, high = values[i], values[i + 1]
    return low + (high - low) * weight


@dataclass(frozen=True)
class Series:
    """Seconds of one measured quantity: ``name``, the fixed parameters it holds for
    (``where``), its ``axes`` and their ``grid`` points, ``seconds`` nested like the grid."""

    name: str
    axes: tuple[str, ...]
    grid: tuple[tuple[float, ...], ...]
    seconds: Any
    where: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if len(self.axes) != len(self.grid) or len(self.axes) > 2:
            problems.append(f"series {self.name!r}: {len(self.axes)} axes and {len(self.grid)} grids (0-2 axes)")
        for axis, points in zip(self.axes, self.grid):
            if not points or any(b <= a for a, b in zip(points, points[1:])):
                problems.append(f"series {self.name!r}: the grid of {axis!r} must be non-empty and increasing")
        shape = [len(points) for points in self.grid]
        if not problems and not _has_shape(self.seconds, shape):
            problems.append(f"series {self.name!r}: seconds must be nested like the grid {shape}")
        if problems:
            raise ConfigError(problems)

    def at(self, *point: float) -> float:
        """The interpolated seconds at ``point`` (one coordinate per axis)."""
        if len(point) != len(self.axes):
            raise ValueError(f"series {self.name!r} has axes {self.axes}, got {len(point)} coordinates")
        if not self.axes:
            return float(self.seconds)
        if len(self.axes) == 1:
            return _along(self.seconds, self.grid[0], point[0])
        rows = self.grid[0]
        i, _ = _segment(rows, point[0])
        pair = [_along(self.seconds[j], self.grid[1], point[1]) for j in (i, min(i + 1, len(rows) - 1))]
        return _along(pair, rows[i:i + 2], point[0])

    def to_json(self) -> dict[str, Any]:
        """The series as written in a table file."""
        return {"name": self.name, "where": self.where, "axes": list(self.axes),
                "grid": [list(points) for points in self.grid], "seconds": self.seconds}


def _has_shape(values: Any, shape: list[int]) -> bool:
    if not shape:
        return isinstance(values, (int, float))
    return (isinstance(values, list) and len(values) == shape[0]
            and all(_has_shape(v, shape[1:]) for v in values))


@dataclass(frozen=True)
class CostTable:
    """One table file: its ``kind``, the ``hardware`` names it measures, the ``model``
    sizes (operators and steps), the ``dtype`` timed, free-form ``meta`` (source,
    license, command, date, machine) and its ``series``."""

    kind: str
    hardware: tuple[str, ...]
    series: tuple[Series, ...]
    model: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    def find(self, name: str, **where: Any) -> Series | None:
        """The series ``name`` whose parameters include ``where``, or None."""
        for series in self.series:
            if series.name == name and all(series.where.get(k) == v for k, v in where.items()):
                return series
        return None

    def values(self, name: str, key: str) -> list[Any]:
        """The values of parameter ``key`` among the series called ``name``, sorted."""
        return sorted({s.where[key] for s in self.series if s.name == name and key in s.where})

    def shape_mismatch(self, shape: Any) -> list[str]:
        """The model sizes in which ``shape`` (a ``ModelShape``) differs from this table."""
        return [f"{key} {getattr(shape, key)} (table: {self.model[key]})" for key in SHAPE_KEYS
                if key in self.model and getattr(shape, key) != self.model[key]]

    def describe(self) -> str:
        """One line naming the table: kind, hardware, model sizes, file."""
        sizes = ", ".join(f"{k} {self.model[k]}" for k in SHAPE_KEYS if k in self.model)
        return f"{self.kind} on {'/'.join(self.hardware)}{' (' + sizes + ')' if sizes else ''}: {Path(self.path).name}"

    def to_json(self) -> dict[str, Any]:
        """The table as written in a file."""
        return {"format": FORMAT, "version": VERSION, "kind": self.kind, "hardware": list(self.hardware),
                "model": self.model, "dtype": self.dtype, "meta": self.meta,
                "series": [s.to_json() for s in self.series]}


def load_table(path: str | Path) -> CostTable:
    """Read and check a table file; a ``ConfigError`` names the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError([f"cost table {path}: cannot be read ({exc})"]) from None
    problems = []
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError([f"cost table {path}: not a {FORMAT} file (its 'format' field)"])
    if data.get("version") != VERSION:
        problems.append(f"cost table {path}: version {data.get('version')!r}, this servelab reads {VERSION}")
    if data.get("kind") not in KINDS:
        problems.append(f"cost table {path}: kind {data.get('kind')!r} is not one of {', '.join(KINDS)}")
    hardware = data.get("hardware")
    if not isinstance(hardware, list) or not hardware or not all(isinstance(h, str) for h in hardware):
        problems.append(f"cost table {path}: 'hardware' must be a list of hardware names")
    if not isinstance(data.get("series"), list) or not data["series"]:
        problems.append(f"cost table {path}: 'series' must be a non-empty list")
    if problems:
        raise ConfigError(problems)
    series = []
    for item in data["series"]:
        try:
            series.append(Series(item["name"], tuple(item["axes"]), tuple(tuple(float(x) for x in g)
                                                                           for g in item["grid"]),
                                 item["seconds"], dict(item.get("where", {}))))
        except (KeyError, TypeError) as exc:
            raise ConfigError([f"cost table {path}: a series lacks {exc}"]) from None
        except ConfigError as exc:
            raise ConfigError([f"cost table {path}: {p}" for p in exc.problems]) from None
    return CostTable(data["kind"], tuple(hardware), tuple(series), dict(data.get("model") or {}), data.get("dtype"),
                     dict(data.get("meta") or {}), str(path))


def save_table(table: CostTable, path: str | Path) -> Path:
    """Write ``table`` as JSON (one series per line, so diffs stay readable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = table.to_json()
    series = data.pop("series")
    head = json.dumps(data, indent=1)[:-2]
    lines = ",\n".join("  " + json.dumps(s) for s in series)
    path.write_text(f"{head},\n \"series\": [\n{lines}\n ]\n}}\n")
    return path


def shipped_tables() -> list[Path]:
    """The tables shipped with servelab (``servelab/plugins/cost_model/tables/*.json``)."""
    folder = importlib.resources.files("servelab.plugins.cost_model").joinpath("tables")
    return sorted(Path(str(item)) for item in folder.iterdir() if item.name.endswith(".json"))
