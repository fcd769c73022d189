"""Splitwise (Patel et al., ISCA 2024): prefill and decode on separate (and different)
machines against mixed machines at about the same cost, servelab's simulation beside the
paper.

Each job of ``experiment=splitwise`` is one setup ``+experiment/splitwise_setup=NAME`` at
one ``workload.trace_rate``. A setup's throughput is the highest rate at which 90% of
requests meet the TTFT and TPOT objectives; its cost is its machines (8 GPUs each) at
``MACHINE_COST_PER_HOUR``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import cell, curve, devices, rate_at_attainment, setup_name

GROUP = "experiment/splitwise_setup"
GPUS_PER_MACHINE = 8
MACHINE_COST_PER_HOUR = {"a100-80gb": 17.6, "h100-80gb": 38.0}
"""US$ per hour of one 8-GPU machine, the DGX-A100 and DGX-H100 prices Splitwise's cost
comparison uses (its Table 2); a setup's cost is what its machines cost."""
BASELINE = "baseline-h100"
PAPER = ("Splitwise: 1.4x the throughput at 20% lower cost than Baseline-H100, or 2.35x the throughput at the "
         "same cost and power (Llama-2-70B, coding and conversation traces)")


def machines(row: dict[str, Any]) -> dict[str, float]:
    """Machines a job used, by hardware."""
    return {name: count / GPUS_PER_MACHINE for name, count in devices(row).items()}


def cost(row: dict[str, Any]) -> float | None:
    """US$ per hour of a job's machines; None for hardware without a price."""
    used = machines(row)
    if any(name not in MACHINE_COST_PER_HOUR for name in used):
        return None
    return sum(MACHINE_COST_PER_HOUR[name] * count for name, count in used.items())


class SplitwiseReport(PaperReport):
    """``experiment=splitwise``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Disaggregated prefill and decode against Splitwise"

    def results(self, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per setup: its jobs, machines, cost and throughput at 90% attainment."""
        found: dict[str, dict[str, Any]] = {}
        for row in rows:
            found.setdefault(setup_name(row, GROUP), {"runs": []})["runs"].append(row)
        for result in found.values():
            first = result["runs"][0]
            result["machines"], result["cost"] = machines(first), cost(first)
            result["throughput"], result["bound"] = rate_at_attainment(curve(result["runs"]))
        return found

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Throughput, cost and throughput per dollar of every setup, and their ratios to
        Baseline-H100's."""
        found = self.results(rows)
        base = found.get(BASELINE)
        body = []
        for name, result in found.items():
            per_dollar = result["throughput"] / result["cost"] if result["throughput"] and result["cost"] else None
            ratios = ["-", "-", "-"]
            if base and base["throughput"] and result["throughput"] and base["cost"] and result["cost"]:
                ratios = [f"{result['throughput'] / base['throughput']:.2f}x", f"{result['cost'] / base['cost']:.2f}x",
                          f"{per_dollar / (base['throughput'] / base['cost']):.2f}x"]
            body.append([name, " + ".join(f"{count:g} {hw}" for hw, count in result["machines"].items()),
                         result["cost"], cell(result["throughput"], result["bound"]),
                         None if per_dollar is None else 1000 * per_dollar, *ratios])
        text = render_markdown(["setup", "machines", "$/h", "throughput req/s (90% SLO)", "req/s per $1000/h",
                                "throughput vs H100", "cost vs H100", "per $ vs H100"], body, "llrrrrrr")
        curves = ["", "Every job (rate req/s: SLO attainment):", ""]
        for name, result in found.items():
            curves.append(f"- {name}: " + ", ".join(f"{r:.3g}: {100 * a:.1f}%" for r, a in curve(result["runs"])))
        return text + "\n".join(curves) + f"\n\nPaper: {PAPER}.\n"

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """SLO attainment against rate, one line per setup, the 90% target dashed."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        fig, axis = plt.subplots(figsize=(6.5, 4.2))
        for name, result in self.results(rows).items():
            points = curve(result["runs"])
            axis.plot([r for r, _ in points], [100 * a for _, a in points], marker="o",
                      label=f"{name} (${result['cost']:.0f}/h)" if result["cost"] else name)
        axis.axhline(90, linestyle="--", color="grey")
        axis.set_xlabel("request rate (req/s)")
        axis.set_ylabel("SLO attainment (%)")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
        save_figure(fig, path)
