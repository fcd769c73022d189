"""Leviathan et al. (2023), *Fast Inference from Transformers via Speculative Decoding*:
tokens per target step and speedup against the draft length k, servelab beside the formulas.

With each draft token accepted with probability a on its own, a target step yields
E = (1 - a^(k+1)) / (1 - a) tokens, and a draft whose step costs c of the target's gives
the walltime speedup E / (k c + 1) (the paper's Eq. 1 and Theorem 3.8). servelab's side is
measured: E = 1 + k x the run's per-draft acceptance, the speedup is the k = 0 run's mean
TPOT over the k run's, and the effective c = (TPOT_k x E / TPOT_0 - 1) / k is what a
target step with k drafts cost beyond one plain step, per draft (verification included).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport, job_config
from servelab.bench.report import render_markdown

PAPER_DRAFT_COST = 0.05
"""The draft-to-target cost ratio c of the comparison (a small draft for a 7B target)."""


def expected_tokens(acceptance: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens per target step with k drafts (k + 1 at a = 1)."""
    if acceptance == 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def expected_speedup(acceptance: float, k: int, draft_cost: float) -> float:
    """E / (k c + 1): walltime speedup over plain decoding with a draft of relative cost c."""
    return expected_tokens(acceptance, k) / (k * draft_cost + 1)


def points(rows: list[dict[str, Any]]) -> dict[float, dict[int, dict[str, Any]]]:
    """Rows by configured acceptance rate, then k."""
    grouped: dict[float, dict[int, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        decoding = job_config(row).decoding
        grouped[float(decoding.simulated_acceptance_rate)][int(decoding.num_speculative_tokens)] = row
    return grouped


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (acceptance, k): the formulas' and servelab's E and speedup and the
    effective draft cost. The formulas take the configured acceptance under simulation and
    the k = 1 run's measured acceptance (exactly a) with the real executor."""
    entries = []
    for rate, by_k in sorted(points(rows).items()):
        base = by_k.get(0)
        first = by_k.get(1)
        measured_a = first["spec_acceptance_rate"] if first is not None else None
        for k, row in sorted(by_k.items()):
            a = rate if row["simulated"] else measured_a
            tokens = 1.0 + k * (row["spec_acceptance_rate"] or 0.0)
            speedup = base["tpot_ms"]["mean"] / row["tpot_ms"]["mean"] if base is not None else None
            cost = (1 / speedup * tokens - 1) / k if speedup is not None and k else None
            entries.append({"rate": rate, "a": a, "k": k, "paper_tokens": None if a is None else expected_tokens(a, k),
                            "tokens": tokens, "paper_speedup": None if a is None else
                            expected_speedup(a, k, PAPER_DRAFT_COST),
                            "speedup": speedup, "draft_cost": cost, "tpot_ms": row["tpot_ms"]["mean"]})
    return entries


class SpecDecodeReport(PaperReport):
    """``experiment=spec_decode_theory``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Speculative decoding against Leviathan et al.'s formulas"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per acceptance rate and k: E and speedup of the formulas (c = 0.05) and servelab's."""
        header = ["a (formula)", "k", "E formula", "E servelab", "speedup formula (c=0.05)", "speedup servelab",
                  "c servelab", "TPOT ms"]
        body = [[e["a"], e["k"], e["paper_tokens"], e["tokens"], e["paper_speedup"], e["speedup"], e["draft_cost"],
                 e["tpot_ms"]] for e in comparison(rows)]
        return render_markdown(header, body, "rrrrrrrr")

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Tokens per target step and speedup against k: formulas dashed, servelab's points solid."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        entries = comparison(rows)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for rate in sorted({e["rate"] for e in entries}):
            mine = [e for e in entries if e["rate"] == rate]
            ks = [e["k"] for e in mine]
            a = mine[-1]["a"] if mine[-1]["a"] is not None else rate
            for axis, paper, ours in zip(axes, ("paper_tokens", "paper_speedup"), ("tokens", "speedup")):
                line, = axis.plot(ks, [e[ours] for e in mine], marker="o", label=f"servelab, a={a:.2f}")
                axis.plot(ks, [e[paper] for e in mine], linestyle="--", color=line.get_color(),
                          label=f"formula, a={a:.2f}")
        axes[0].set_ylabel("tokens per target step (E)")
        axes[1].set_ylabel(f"speedup over k = 0 (formula: c = {PAPER_DRAFT_COST})")
        for axis in axes:
            axis.set_xlabel("draft tokens k")
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        save_figure(fig, path)
