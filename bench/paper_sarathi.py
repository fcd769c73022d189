"""Sarathi-Serve (Agrawal et al., OSDI 2024): serving capacity of chunked prefills against
vLLM-style and request-level batching, servelab beside the paper.

Capacity is the highest Poisson rate whose P99 time between tokens meets the SLO and whose
median scheduling delay is at most 2 s (``mode=capacity``). Each job of
``experiment=sarathi_capacity`` is one setup ``+paper_setup/sarathi_capacity=MODEL-LEVEL-SYSTEM``
(conf/paper_setup/sarathi_capacity/): a model and SLO level, and a system (``sarathi``,
``vllm``, ``orca``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport
from servelab.bench.report import render_markdown

SETUP_GROUP = "+paper_setup/sarathi_capacity="
"""The override that names a job's setup."""

SYSTEMS = ("sarathi", "vllm", "orca")
"""The compared systems, in table order."""

PAPER_GAIN_OVER_VLLM = {"mistral-7b": 2.6, "yi-34b": 3.7, "falcon-180b": 5.6}
"""The paper's headline capacity gains of Sarathi-Serve over vLLM (its best SLO setting)."""


def setup_of(row: dict[str, Any]) -> tuple[str, str, str]:
    """``(model, level, system)`` of a job, from its setup override."""
    name = next(o[len(SETUP_GROUP):] for o in row["job"]["overrides"] if o.startswith(SETUP_GROUP))
    model, level, system = name.rsplit("-", 2)
    return model, level, system


def capacities(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """Capacity results by (model, level), then system."""
    found: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        model, level, system = setup_of(row)
        found.setdefault((model, level), {})[system] = row
    return found


def capacity_cell(row: dict[str, Any] | None) -> str:
    """A capacity in req/s, marked when the search hit an end of its range."""
    if row is None:
        return "-"
    result = row["capacity"]
    value = f"{result['capacity_rps']:.3g}"
    if result["limited_by"] == "rate_high":
        return f">= {value}"
    if result["limited_by"] == "rate_low":
        return f"< {result['bracket'][1]:.3g}"
    return value


def bubble_cell(row: dict[str, Any] | None) -> str:
    """Mean share of the busy time each pipeline stage sat idle, at the capacity found
    (``-`` without pipeline parallelism)."""
    fractions = [f for f in (row or {}).get("system", {}).get("stage_bubble_fraction", []) if f is not None]
    if len(fractions) < 2:
        return "-"
    return f"{100 * sum(fractions) / len(fractions):.1f}%"


def ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> float | None:
    """Capacity ratio of two runs; None when either is missing or zero."""
    if numerator is None or denominator is None or not denominator["capacity"]["capacity_rps"]:
        return None
    return numerator["capacity"]["capacity_rps"] / denominator["capacity"]["capacity_rps"]


class SarathiReport(PaperReport):
    """``experiment=sarathi_capacity``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Serving capacity against Sarathi-Serve"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per model and SLO: each system's capacity, the ratios, the paper's gain and, with
        pipeline stages, each system's pipeline bubble at its capacity."""
        header = ["model", "SLO", "P99 TBT SLO ms", "sched. delay P50 SLO ms", "Sarathi req/s", "vLLM req/s",
                  "Orca-16 req/s", "Sarathi / vLLM", "Sarathi / Orca-16", "paper Sarathi / vLLM (best SLO)",
                  "pipeline bubble Sarathi / vLLM / Orca-16"]
        body = []
        for (model, level), runs in capacities(rows).items():
            first = next(iter(runs.values()))["capacity"]
            body.append([model, level, first["slo_tbt_p99_ms"], first["slo_scheduling_delay_p50_ms"],
                         *(capacity_cell(runs.get(s)) for s in SYSTEMS),
                         ratio(runs.get("sarathi"), runs.get("vllm")), ratio(runs.get("sarathi"), runs.get("orca")),
                         f"up to {PAPER_GAIN_OVER_VLLM[model]}x" if model in PAPER_GAIN_OVER_VLLM else "-",
                         bubbles if (bubbles := " / ".join(bubble_cell(runs.get(s)) for s in SYSTEMS)) != "- / - / -"
                         else "-"])
        trials = ["", "Every trial (rate req/s: P99 TBT ms / median scheduling delay ms, + meets the SLO):", ""]
        for row in rows:
            steps = ", ".join(f"{t['rate']:.3g}: {t['tbt_p99_ms']:.4g} / {t.get('scheduling_delay_p50_ms', float('nan')):.4g}"
                              f"{' +' if t['meets_slo'] else ''}" for t in row["capacity"]["trials"])
            trials.append(f"- {'-'.join(setup_of(row))}: {steps}")
        return render_markdown(header, body, "llrrrrrrrrr") + "\n".join(trials) + "\n"

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Capacity bars per setup and system; TBT CDFs of Sarathi and vLLM at their capacities."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        found = capacities(rows)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        width = 0.8 / len(SYSTEMS)
        for i, system in enumerate(SYSTEMS):
            values = [runs[system]["capacity"]["capacity_rps"] if system in runs else 0.0 for runs in found.values()]
            axes[0].bar([x + i * width for x in range(len(found))], values, width, label=system)
        axes[0].set_xticks([x + width for x in range(len(found))])
        axes[0].set_xticklabels([f"{m}\n{lvl}" for m, lvl in found], fontsize=8)
        axes[0].set_ylabel("capacity (req/s)")
        axes[0].legend(fontsize=8)
        for (model, level), runs in found.items():
            for system in ("sarathi", "vllm"):
                run = runs.get(system)
                samples = Path(run["job"]["dir"]) / "samples.json" if run is not None else None
                if samples is None or not samples.is_file():
                    continue
                gaps = sorted(json.loads(samples.read_text())["itl_ms"])
                if gaps:
                    axes[1].plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))],
                                 label=f"{model} {level} {system} @ {run['capacity']['capacity_rps']:.3g}/s")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("time between tokens (ms), at each system's capacity")
        axes[1].set_ylabel("CDF")
        axes[1].legend(fontsize=6)
        for axis in axes:
            axis.grid(alpha=0.3)
        save_figure(fig, path)
