"""At the end of a ``-m`` sweep: the jobs' rows, a markdown table and plots in the sweep folder.

The report is gathered in the launching process after every job ended, from the job
folders alone, so it is the same whichever Hydra launcher ran the jobs (in this process,
in worker processes, on SLURM nodes or Ray workers; those need the sweep folder on a
filesystem they share). Rebuild it at any time with
``python -m servelab.bench.sweep_report SWEEP_DIR``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from servelab.bench.job_failure import ERROR_FILE
from servelab.bench.report import markdown_table, render_markdown

log = logging.getLogger(__name__)

UNFINISHED = "no metrics.json: the job ended without finishing (killed? see its launcher's log)"
"""The error reported for a job folder that holds neither ``metrics.json`` nor ``error.json``."""


def _unfinished(folder: Path) -> dict[str, Any]:
    hydra_cfg = OmegaConf.load(folder / ".hydra" / "hydra.yaml").hydra
    return {"job": {"num": hydra_cfg.job.num, "label": None, "overrides": list(hydra_cfg.overrides.task)},
            "error": UNFINISHED}


def collect_jobs(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(rows, failures)`` of the jobs under ``sweep_dir``, each in job order. Rows are
    the jobs' ``metrics.json``; failures are the jobs' ``error.json`` (``job`` and
    ``error``) and, for a job folder with neither file, its Hydra overrides and
    ``UNFINISHED``. Every entry gets ``job.dir`` (its folder), ``job.label`` (``label=``
    if given, else the overrides that differ between jobs) and ``job.group`` (those
    overrides without ``workload.rate``: the jobs of one throughput-latency curve)."""
    rows, failures = [], []
    for folder in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        if (folder / "metrics.json").is_file():
            entry = json.loads((folder / "metrics.json").read_text())
            rows.append(entry)
        elif (folder / ERROR_FILE).is_file():
            entry = json.loads((folder / ERROR_FILE).read_text())
            failures.append(entry)
        elif (folder / ".hydra" / "hydra.yaml").is_file():
            entry = _unfinished(folder)
            failures.append(entry)
        else:
            continue
        entry["job"]["dir"] = str(folder)
    jobs = rows + failures
    common = set.intersection(*(set(j["job"]["overrides"]) for j in jobs)) if jobs else set()
    for entry in jobs:
        varying = [o for o in entry["job"]["overrides"] if o not in common]
        entry["job"]["label"] = entry["job"]["label"] or ", ".join(varying) or "default"
        entry["job"]["group"] = ", ".join(o for o in varying if not o.startswith("workload.rate=")) or "default"
    rows.sort(key=lambda r: r["job"]["num"])
    failures.sort(key=lambda r: r["job"]["num"])
    return rows, failures


def one_line(text: str) -> str:
    """``text`` on one line (its lines stripped and joined by spaces), for table cells."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def failures_table(failures: list[dict[str, Any]]) -> str:
    """A markdown table of the failed jobs: label, folder and error."""
    return render_markdown(["job", "folder", "error"],
                           [[one_line(f["job"]["label"]).replace("|", "\\|"), f["job"]["dir"],
                             one_line(f["error"]).replace("|", "\\|")] for f in failures])


def write_report(sweep_dir: Path) -> tuple[list[Path], list[dict[str, Any]]]:
    """Write ``rows.jsonl``, ``results.md`` (the jobs' table, then a "Failed jobs" table
    when any failed), ``throughput_latency.png`` and ``tbt_cdf.png`` into ``sweep_dir``;
    returns the files written (none without jobs) and the failures."""
    from servelab.bench.plots import plot_tbt_cdf, plot_throughput_latency

    rows, failures = collect_jobs(sweep_dir)
    if not rows and not failures:
        return [], []
    files = [sweep_dir / "rows.jsonl", sweep_dir / "results.md"]
    files[0].write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = f"# servelab-bench sweep: {sweep_dir}\n\n" + (markdown_table(rows) if rows else "No job finished.\n")
    if failures:
        text += f"\n## Failed jobs\n\n{len(failures)} of {len(rows) + len(failures)} jobs failed.\n\n"
        text += failures_table(failures)
    files[1].write_text(text)
    if rows:
        files.append(sweep_dir / "throughput_latency.png")
        plot_throughput_latency(rows, str(files[-1]))
        samples = [(row["job"]["label"], Path(row["job"]["dir"]) / "samples.json") for row in rows]
        gaps = [(label, json.loads(path.read_text())["itl_ms"]) for label, path in samples if path.is_file()]
        if gaps:
            files.append(sweep_dir / "tbt_cdf.png")
            plot_tbt_cdf(gaps, str(files[-1]))
    return files, failures


def failure_summary(failures: list[dict[str, Any]], results: Path) -> str:
    """One message naming every failed job, its error and the report's path."""
    jobs = "; ".join(f"job {f['job']['num']} ({f['job']['label']}): {one_line(f['error'])}" for f in failures)
    return f"servelab-bench sweep: {len(failures)} job(s) failed: {jobs}. Report: {results}"


class SweepReport(Callback):
    """Hydra callback (``hydra.callbacks.sweep_report`` in ``bench.yaml``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the sweep's table and plots and print the table; when a job failed, name
        it on stderr and exit with status 1 (Hydra turns a callback's exceptions into
        warnings, so the status is set here)."""
        sweep_dir = Path(config.hydra.sweep.dir)
        files, failures = write_report(sweep_dir)
        if files:
            print(files[1].read_text())
            log.info("sweep report: %s", ", ".join(str(f) for f in files))
        if failures:
            print(failure_summary(failures, files[1]), file=sys.stderr)
            sys.exit(1)


def main(argv: list[str]) -> int:
    """``python -m servelab.bench.sweep_report SWEEP_DIR``: rewrite a sweep's report from
    its job folders and print it; exit status 1 when a job failed, 2 without jobs."""
    if len(argv) != 1:
        print("usage: python -m servelab.bench.sweep_report SWEEP_DIR", file=sys.stderr)
        return 2
    sweep_dir = Path(argv[0])
    files, failures = write_report(sweep_dir) if sweep_dir.is_dir() else ([], [])
    if not files:
        print(f"SWEEP_DIR: no job folder in {sweep_dir}", file=sys.stderr)
        return 2
    print(files[1].read_text())
    if failures:
        print(failure_summary(failures, files[1]), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
