"""A seed paper's comparison at the end of a ``-m`` sweep: servelab's numbers beside the paper's.

An experiment preset that reproduces a paper adds its report as a Hydra callback
(``hydra.callbacks.paper_report._target_``); after the sweep report it writes
``paper.md`` (the comparison table) and ``paper.png`` (the figure) into the sweep folder
from the job folders. Rebuild them with ``python -m servelab.bench.paper_report
SWEEP_DIR REPORT_CLASS`` (e.g. ``servelab.bench.paper_spec_decode.SpecDecodeReport``).
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from servelab.bench.sweep_report import collect_jobs

log = logging.getLogger(__name__)


def job_config(row: dict[str, Any]) -> DictConfig:
    """The resolved config a job ran with (its folder's ``config.yaml``)."""
    return OmegaConf.load(Path(row["job"]["dir"]) / "config.yaml")


class PaperReport(Callback):
    """Base of the papers' reports: subclasses set ``title`` and implement ``table``
    (markdown) and ``plot`` (a PNG at the path given) over the sweep's rows."""

    title = ""

    def table(self, rows: list[dict[str, Any]]) -> str:
        """The comparison in markdown: servelab's numbers beside the paper's."""
        raise NotImplementedError

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """The comparison as a figure at ``path``."""
        raise NotImplementedError

    def write(self, sweep_dir: Path) -> list[Path]:
        """Write ``paper.md`` and ``paper.png`` into ``sweep_dir`` from its finished jobs;
        the files written (none when no job finished)."""
        rows, _ = collect_jobs(sweep_dir)
        if not rows:
            return []
        text = f"# {self.title}\n\nSweep: {sweep_dir}\n\n{self.table(rows)}"
        files = [sweep_dir / "paper.md", sweep_dir / "paper.png"]
        files[0].write_text(text)
        self.plot(rows, files[1])
        return files

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write and print the comparison."""
        files = self.write(Path(config.hydra.sweep.dir))
        if files:
            print(files[0].read_text())
            log.info("paper report: %s", ", ".join(str(f) for f in files))


def main(argv: list[str]) -> int:
    """``python -m servelab.bench.paper_report SWEEP_DIR MODULE.CLASS``: rewrite a sweep's
    paper comparison and print it; exit status 2 on bad arguments or without jobs."""
    if len(argv) != 2:
        print("usage: python -m servelab.bench.paper_report SWEEP_DIR MODULE.CLASS", file=sys.stderr)
        return 2
    module, _, name = argv[1].rpartition(".")
    report = getattr(importlib.import_module(module), name)()
    files = report.write(Path(argv[0])) if Path(argv[0]).is_dir() else []
    if not files:
        print(f"SWEEP_DIR: no finished job in {argv[0]}", file=sys.stderr)
        return 2
    print(files[0].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
