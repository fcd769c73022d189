"""Orca (Yu et al., OSDI 2022): iteration-level against request-level batching at equal
latency, servelab beside the paper's headline.

Each job of ``experiment=orca_iteration_level`` is a ``mode=capacity`` search of one
scheduler against ``slo.normalized_latency_ms``; the throughput compared is the output
throughput of the run at the sustained rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport, job_config
from servelab.bench.paper_vllm import rate_cell
from servelab.bench.report import render_markdown

PAPER_GAIN = 36.9
"""Orca's throughput over FasterTransformer's request-level batching at the same latency
(GPT-3 175B)."""


def by_scheduler(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows by scheduler name (``static``, ``continuous``)."""
    return {next(o.split("=", 1)[1] for o in row["job"]["overrides"] if o.startswith("scheduler=")): row
            for row in rows}


class OrcaReport(PaperReport):
    """``experiment=orca_iteration_level``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Iteration-level batching against Orca's claim"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Each scheduler's sustained rate and throughput at the latency bound, and the gain."""
        found = by_scheduler(rows)
        header = ["scheduler", "max batch", "normalized latency SLO ms", "sustained req/s", "output tok/s there",
                  "normalized latency there ms"]
        body = []
        for name, row in found.items():
            scheduler = job_config(row).scheduler
            body.append([name, scheduler.get("max_batch_size", scheduler.get("max_num_seqs")),
                         row["capacity"]["slo_normalized_latency_ms"], rate_cell(row),
                         row["output_throughput"], row["normalized_latency_ms"]])
        text = render_markdown(header, body, "lrrrrr")
        if "static" in found and "continuous" in found and found["static"]["output_throughput"]:
            gain = found["continuous"]["output_throughput"] / found["static"]["output_throughput"]
            at_least = "at least " if found["continuous"]["capacity"]["limited_by"] == "rate_high" else ""
            text += (f"\nIteration-level over request-level throughput at the same latency bound: {at_least}"
                     f"**{gain:.3g}x** "
                     f"(Orca: {PAPER_GAIN}x over FasterTransformer, GPT-3 175B).\n")
        notes = ["", "Every trial (rate req/s: normalized latency ms, + within the SLO):", ""]
        for name, row in found.items():
            trials = sorted(row["capacity"]["trials"], key=lambda t: t["rate"])
            notes.append(f"- {name}: " + ", ".join(
                f"{t['rate']:.3g}: {t['normalized_latency_ms']:.4g}{' +' if t['meets_slo'] else ''}" for t in trials))
        return text + "\n".join(notes) + "\n"

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Normalized latency against rate (the searches' trials), one line per scheduler."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        fig, axis = plt.subplots(figsize=(6, 4.2))
        limit = None
        for name, row in by_scheduler(rows).items():
            limit = row["capacity"]["slo_normalized_latency_ms"]
            trials = sorted(row["capacity"]["trials"], key=lambda t: t["rate"])
            axis.plot([t["rate"] for t in trials], [t["normalized_latency_ms"] / 1000 for t in trials], marker="o",
                      label=f"{name} (sustains {row['capacity']['capacity_rps']:.3g}/s)")
        if limit is not None:
            axis.axhline(limit / 1000, color="gray", linestyle=":", label="latency bound")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel("normalized latency (s/token)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        save_figure(fig, path)
