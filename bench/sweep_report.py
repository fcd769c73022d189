"""At the end of a ``-m`` sweep: the jobs' rows, a markdown table and plots in the sweep folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from servelab.bench.report import markdown_table

log = logging.getLogger(__name__)


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's ``metrics.json`` under ``sweep_dir``, in job order, with ``job.dir``
    (its folder), ``job.label`` (``label=`` if given, else the overrides that differ
    between jobs) and ``job.group`` (those overrides without ``workload.rate``: the
    jobs of one throughput-latency curve)."""
    rows = []
    for path in sweep_dir.glob("*/metrics.json"):
        row = json.loads(path.read_text())
        row["job"]["dir"] = str(path.parent)
        rows.append(row)
    rows.sort(key=lambda r: r["job"]["num"])
    common = set.intersection(*(set(r["job"]["overrides"]) for r in rows)) if rows else set()
    for row in rows:
        varying = [o for o in row["job"]["overrides"] if o not in common]
        row["job"]["label"] = row["job"]["label"] or ", ".join(varying) or "default"
        row["job"]["group"] = ", ".join(o for o in varying if not o.startswith("workload.rate=")) or "default"
    return rows


def write_report(sweep_dir: Path) -> list[Path]:
    """Write ``rows.jsonl``, ``results.md``, ``throughput_latency.png`` and
    ``tbt_cdf.png`` into ``sweep_dir``; returns the files written (none without rows)."""
    from servelab.bench.plots import plot_tbt_cdf, plot_throughput_latency

    rows = collect_rows(sweep_dir)
    if not rows:
        return []
    files = [sweep_dir / name for name in ("rows.jsonl", "results.md", "throughput_latency.png", "tbt_cdf.png")]
    files[0].write_text("".join(json.dumps(row) + "\n" for row in rows))
    files[1].write_text(f"# servelab-bench sweep: {sweep_dir}\n\n{markdown_table(rows)}")
    plot_throughput_latency(rows, str(files[2]))
    gaps = [(row["job"]["label"], json.loads((Path(row["job"]["dir"]) / "samples.json").read_text())["itl_ms"])
            for row in rows]
    plot_tbt_cdf(gaps, str(files[3]))
    return files


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report`` in ``bench.yaml``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the sweep's table and plots and print the table."""
        sweep_dir = Path(config.hydra.sweep.dir)
        files = write_report(sweep_dir)
        if files:
            print(files[1].read_text())
            log.info("sweep report: %s", ", ".join(str(f) for f in files))
