"""PagedAttention (Kwon et al., SOSP 2023): the rate each KV cache sustains at a bounded
normalized latency, and the share of reserved KV memory that holds tokens, servelab beside
the paper.

Each job of ``experiment=vllm_paper`` is a ``mode=capacity`` search against
``slo.normalized_latency_ms`` for one workload (``+paper_setup/vllm_paper_workload``) and
one system (``+paper_setup/vllm_paper_system``: ``vllm`` = the paged cache, ``orca-*`` =
the contiguous cache with that reservation); its trials are the latency-rate curve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport
from servelab.bench.report import render_markdown

WORKLOAD = "+paper_setup/vllm_paper_workload="
SYSTEM = "+paper_setup/vllm_paper_system="
"""The overrides that name a job's workload and system."""

SYSTEMS = ("vllm", "orca-oracle", "orca-pow2", "orca-max")
"""The compared systems, in table order."""

PAPER = {"vs_oracle": "1.7-2.7x", "vs_max": "2.7-8x", "token_share": "20.4-38.2%"}
"""The paper's figures: paged over Orca-Oracle and Orca-Max in sustained rate on ShareGPT
at similar latency, and the share of reserved KV memory that holds tokens in the prior
systems."""


def setup_of(row: dict[str, Any]) -> tuple[str, str]:
    """``(workload, system)`` of a job, from its setup overrides."""
    overrides = row["job"]["overrides"]
    return (next(o[len(WORKLOAD):] for o in overrides if o.startswith(WORKLOAD)),
            next(o[len(SYSTEM):] for o in overrides if o.startswith(SYSTEM)))


def by_workload(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Rows by workload, then system."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        workload, system = setup_of(row)
        found.setdefault(workload, {})[system] = row
    return found


def sustained(row: dict[str, Any] | None) -> float | None:
    """The sustained rate (the search's capacity); None for a missing run or capacity 0."""
    return row["capacity"]["capacity_rps"] or None if row is not None else None


def bound(row: dict[str, Any] | None) -> str:
    """``">= "`` when the search's top rate still met the bound (the rate is a lower
    bound), ``"< "`` when its lowest missed it, else ``""``."""
    limited = row["capacity"]["limited_by"] if row is not None else None
    return {"rate_high": ">= ", "rate_low": "< "}.get(limited, "")


def rate_cell(row: dict[str, Any] | None) -> str:
    """A sustained rate in req/s, marked when the search hit an end of its range."""
    if row is None:
        return "-"
    if row["capacity"]["limited_by"] == "rate_low":
        return f"< {row['capacity']['bracket'][1]:.3g}"
    return f"{bound(row)}{row['capacity']['capacity_rps']:.3g}"


def ratio_cell(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> str:
    """numerator / denominator's sustained rates, ``>=`` / ``<=`` when one is a range end's
    bound; "-" when both are or either is missing."""
    value = over(sustained(numerator), sustained(denominator))
    marks = (bound(numerator).strip(), bound(denominator).strip())
    if value is None or all(marks):
        return "-"
    prefix = ">= " if marks[0] == ">=" or marks[1] == "<" else "<= " if marks[1] == ">=" or marks[0] == "<" else ""
    return f"{prefix}{value:.3g}"


def token_share(row: dict[str, Any] | None) -> float | None:
    """Time-weighted share of reserved KV slots holding a token, in the run at the
    sustained rate (1 - ``system.kv_waste``)."""
    waste = row["system"].get("kv_waste") if row is not None else None
    return None if waste is None else 1 - waste


def over(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing."""
    return numerator / denominator if numerator and denominator else None


class VllmPaperReport(PaperReport):
    """``experiment=vllm_paper``'s comparison (``paper.md``, ``paper.png``)."""

    title = "KV cache management against the PagedAttention paper"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per workload: each system's sustained rate and token share, the ratios, the paper's."""
        header = ["workload", "normalized latency SLO ms", *(f"{s} req/s" for s in SYSTEMS),
                  "vllm / orca-oracle", "vllm / orca-max", "paper (ShareGPT)",
                  *(f"{s} KV holding tokens %" for s in SYSTEMS), "paper (Orca)"]
        body = []
        for workload, runs in by_workload(rows).items():
            shares = [token_share(runs.get(s)) for s in SYSTEMS]
            limit = next(iter(runs.values()))["capacity"]["slo_normalized_latency_ms"]
            body.append([workload, limit, *(rate_cell(runs.get(s)) for s in SYSTEMS),
                         ratio_cell(runs.get("vllm"), runs.get("orca-oracle")),
                         ratio_cell(runs.get("vllm"), runs.get("orca-max")),
                         f"{PAPER['vs_oracle']} / {PAPER['vs_max']}",
                         *(None if s is None else 100 * s for s in shares), PAPER["token_share"]])
        notes = ["", "Every trial (rate req/s: normalized latency ms, + within the SLO):", ""]
        for row in rows:
            trials = sorted(row["capacity"]["trials"], key=lambda t: t["rate"])
            notes.append(f"- {' '.join(setup_of(row))}: " + ", ".join(
                f"{t['rate']:.3g}: {t['normalized_latency_ms']:.4g}{' +' if t['meets_slo'] else ''}" for t in trials))
        return render_markdown(header, body, "l" + "r" * (len(header) - 1)) + "\n".join(notes) + "\n"

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Normalized latency against rate (the searches' trials), one panel per workload."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        found = by_workload(rows)
        fig, axes = plt.subplots(1, len(found), figsize=(5.5 * len(found), 4.2), squeeze=False)
        for axis, (workload, runs) in zip(axes[0], found.items()):
            limit = next(iter(runs.values()))["capacity"]["slo_normalized_latency_ms"]
            for system in SYSTEMS:
                if system not in runs:
                    continue
                trials = sorted(runs[system]["capacity"]["trials"], key=lambda t: t["rate"])
                axis.plot([t["rate"] for t in trials], [t["normalized_latency_ms"] / 1000 for t in trials],
                          marker="o", label=f"{system} (sustains {runs[system]['capacity']['capacity_rps']:.3g}/s)")
            axis.axhline(limit / 1000, color="gray", linestyle=":", label="latency bound")
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.set_title(workload)
            axis.set_xlabel("request rate (req/s)")
            axis.set_ylabel("normalized latency (s/token)")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
        save_figure(fig, path)
