"""Colocated against disaggregated serving at equal GPU counts: which design serves the most
requests per GPU within the SLOs, per model, prompt/output length ratio and SLO scale.

Each job of ``experiment=colocated_vs_disaggregated`` is one scenario
``+experiment/colocated_vs_disaggregated_scenario=MODEL-WORKLOAD`` (the model and its split,
the lengths, the base SLO) and one system ``+experiment/colocated_vs_disaggregated_system=NAME``
at one ``workload.rate``. A system's name gives its design: ``chunked`` (Sarathi-Serve's
chunked prefills), ``vllm`` (whole prefills first), ``<P>p<D>d`` (DistServe's prefill and
decode pools). At SLO scale ``s`` a request meets the SLO when its TTFT and TPOT are at most
``s`` times the job's ``slo.ttft_ms`` and ``slo.tpot_ms`` (read from ``samples.json``);
goodput is the rate per GPU where that attainment falls to 90% (``slo_goodput``). A
design's goodput is its best system's (disaggregation's best split); a cell's winner is
the design with the highest goodput, its margin the ratio over the runner-up, a bound when
either lay outside the swept rates.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from servelab.bench.paper_report import PaperReport, job_config
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import cell, devices, rate_at_attainment, setup_name

SCENARIO = "experiment/colocated_vs_disaggregated_scenario"
SYSTEM = "experiment/colocated_vs_disaggregated_system"
DESIGNS = {"chunked": "chunked (Sarathi)", "vllm": "vLLM", "disaggregated": "disaggregated (DistServe)"}
"""The compared designs, in table order, with their column names."""
COLORS = {"chunked": "tab:blue", "vllm": "tab:orange", "disaggregated": "tab:green"}
"""Each design's colour in the figure."""
SLO_SCALES = {"tight": 0.5, "medium": 1.0, "loose": 2.0}
"""The SLO scales compared by default: factors on every job's base TTFT and TPOT objectives."""
SPLIT = re.compile(r"\d+p\d+d")
"""A disaggregated system's option name: prefill and decode instances."""


def design_of(system: str) -> str:
    """The design a system option runs: ``disaggregated`` for a ``<P>p<D>d`` split, else the
    option's first word (``chunked``, ``vllm``)."""
    return "disaggregated" if SPLIT.fullmatch(system) else system.split("-", 1)[0]


@lru_cache(maxsize=None)
def job_samples(folder: str) -> tuple[list[tuple[float, float]], float, float]:
    """A job's ``(TTFT ms, TPOT ms)`` per completed request and its TTFT and TPOT SLOs (ms);
    ``ValueError`` when its samples do not pair them (outputs of one token have no TPOT)."""
    samples = json.loads((Path(folder) / "samples.json").read_text())
    ttft, tpot = samples["ttft_ms"], samples["tpot_ms"]
    if len(ttft) != len(tpot):
        raise ValueError(f"{folder}: {len(ttft)} TTFT against {len(tpot)} TPOT samples; the scenarios' outputs "
                         f"must be at least 2 tokens")
    slo = job_config({"job": {"dir": folder}}).slo
    return list(zip(ttft, tpot)), slo.ttft_ms, slo.tpot_ms


def attainment(row: dict[str, Any], scale: float) -> float:
    """The share of the job's completed requests whose TTFT and TPOT are both within
    ``scale`` times its SLO."""
    pairs, ttft_ms, tpot_ms = job_samples(row["job"]["dir"])
    good = sum(a <= scale * ttft_ms and b <= scale * tpot_ms for a, b in pairs)
    return good / len(pairs) if pairs else 0.0


@dataclass(frozen=True)
class Goodput:
    """A system's goodput in req/s/GPU: ``value`` with its ``bound`` (``""`` found,
    ``">="`` at least, every swept rate met 90%; ``"<"`` below, none did) and ``system``."""

    value: float
    bound: str
    system: str

    @property
    def rank(self) -> float:
        """What the designs are ordered by: below the swept rates ranks under any rate."""
        return 0.0 if self.bound == "<" else self.value


def margin(winner: Goodput, runner_up: Goodput) -> tuple[float | None, str]:
    """The winner's goodput over the runner-up's with its bound: ``""`` exact, ``">"`` at
    least (either lay beyond its end of the swept rates); None when both lay beyond the
    same end (no winner)."""
    if winner.bound == runner_up.bound and winner.bound in ("<", ">="):
        return None, ""
    if winner.bound or runner_up.bound:
        return winner.value / runner_up.value, ">"
    return winner.value / runner_up.value, ""


@dataclass
class Cell:
    """One (model, workload, SLO scale): each design's best goodput, the winner and margin."""

    model: str
    workload: str
    scale_name: str
    scale: float
    ttft_ms: float
    tpot_ms: float
    best: dict[str, Goodput]
    winner: str | None
    ratio: float | None
    ratio_bound: str


class ColocatedVsDisaggregatedReport(PaperReport):
    """``experiment=colocated_vs_disaggregated``'s comparison (``paper.md``, ``paper.png``);
    ``slo_scales``: name -> factor on every job's SLO (default ``SLO_SCALES``)."""

    title = "Colocated against disaggregated serving at equal GPU counts"

    def __init__(self, slo_scales: Mapping[str, float] | None = None):
        self.slo_scales = dict(slo_scales or SLO_SCALES)

    def scenarios(self, rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, list[dict[str, Any]]]]:
        """Jobs by (model, workload), then system, in sweep order."""
        found: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
        for row in rows:
            model, workload = setup_name(row, SCENARIO).rsplit("-", 1)
            found.setdefault((model, workload), {}).setdefault(setup_name(row, SYSTEM), []).append(row)
        return found

    def goodputs(self, runs: list[dict[str, Any]]) -> dict[str, Goodput]:
        """One system's goodput per GPU at every SLO scale."""
        count = sum(devices(runs[0]).values())
        found = {}
        for name, scale in self.slo_scales.items():
            rate, bound = rate_at_attainment(sorted((r["workload"]["rate"], attainment(r, scale)) for r in runs))
            found[name] = Goodput(rate / count, bound, setup_name(runs[0], SYSTEM))
        return found

    def cells(self, rows: list[dict[str, Any]]) -> list[Cell]:
        """Every (model, workload, SLO scale) with each design's best system and the winner."""
        result = []
        for (model, workload), systems in self.scenarios(rows).items():
            per_system = {system: self.goodputs(runs) for system, runs in systems.items()}
            slo = job_config(next(iter(systems.values()))[0]).slo
            for name, scale in self.slo_scales.items():
                best: dict[str, Goodput] = {}
                for system, found in per_system.items():
                    design = design_of(system)
                    if design not in best or found[name].rank > best[design].rank:
                        best[design] = found[name]
                ranked = sorted(best, key=lambda d: best[d].rank, reverse=True)
                ratio, bound, winner = None, "", ranked[0]
                if len(ranked) > 1:
                    ratio, bound = margin(best[ranked[0]], best[ranked[1]])
                    winner = winner if ratio is not None else None
                result.append(Cell(model, workload, name, scale, scale * slo.ttft_ms, scale * slo.tpot_ms, best,
                                   winner, ratio, bound))
        return result

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per model, workload and SLO scale: each design's goodput (req/s/GPU at 90%
        attainment; the best split or budget beside it), the winner and its margin; then
        every system's goodput and every job's attainment."""
        scenarios = self.scenarios(rows)
        lengths = {key: tuple(sum(r[f"mean_{k}_tokens"] for s in systems.values() for r in s)
                              / sum(len(s) for s in systems.values()) for k in ("prompt", "output"))
                   for key, systems in scenarios.items()}
        gpus = {key: sum(devices(next(iter(systems.values()))[0]).values()) for key, systems in scenarios.items()}
        body = []
        for c in self.cells(rows):
            prompt, output = lengths[(c.model, c.workload)]
            body.append([c.model, gpus[(c.model, c.workload)], c.workload, f"{prompt:.0f} / {output:.0f}",
                         c.scale_name, f"{c.ttft_ms:g} / {c.tpot_ms:g}",
                         *(self._goodput_cell(c.best.get(d)) for d in DESIGNS),
                         DESIGNS[c.winner] if c.winner else "none",
                         "-" if c.ratio is None else f"{c.ratio_bound + ' ' if c.ratio_bound else ''}{c.ratio:.2f}x"])
        text = render_markdown(["model", "GPUs", "workload", "mean prompt / output tokens", "SLO", "TTFT / TPOT SLO ms",
                                *(f"{label} req/s/GPU" for label in DESIGNS.values()), "winner", "over runner-up"],
                               body, "lrllllrrrlr")
        every = []
        for (model, workload), systems in scenarios.items():
            for system, runs in systems.items():
                found = self.goodputs(runs)
                every.append([model, workload, system, *(cell(g.value, g.bound) for g in found.values())])
        text += "\nEvery system's goodput (req/s/GPU at 90% SLO attainment):\n\n"
        text += render_markdown(["model", "workload", "system", *self.slo_scales], every, "lll" + "r" * len(self.slo_scales))
        curves = ["", f"Every job (rate req/s: SLO attainment at {' / '.join(self.slo_scales)}):", ""]
        for (model, workload), systems in scenarios.items():
            for system, runs in systems.items():
                points = ", ".join(f"{r['workload']['rate']:g}: " + " / ".join(f"{100 * attainment(r, s):.0f}%"
                                                                               for s in self.slo_scales.values())
                                   for r in sorted(runs, key=lambda r: r["workload"]["rate"]))
                curves.append(f"- {model}-{workload} {system}: {points}")
        return text + "\n".join(curves) + "\n"

    @staticmethod
    def _goodput_cell(goodput: Goodput | None) -> str:
        """A design's goodput, with the split or variant that reached it when it has several."""
        if goodput is None:
            return "-"
        variant = f" ({goodput.system})" if design_of(goodput.system) != goodput.system else ""
        return cell(goodput.value, goodput.bound) + variant

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Per model, a grid over (workload x SLO scale): the winner's colour, shaded by its
        margin over the runner-up (full at 3x and more), the margin and best split written in."""
        from matplotlib.patches import Patch

        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        cells = self.cells(rows)
        models = list(dict.fromkeys(c.model for c in cells))
        workloads = list(dict.fromkeys(c.workload for c in cells))
        scales = list(self.slo_scales)
        fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 1.3 + 1.1 * len(scales)), squeeze=False)
        for axis, model in zip(axes[0], models):
            axis.set_xlim(-0.5, len(workloads) - 0.5)
            axis.set_ylim(len(scales) - 0.5, -0.5)
            for c in (c for c in cells if c.model == model):
                x, y = workloads.index(c.workload), scales.index(c.scale_name)
                shade = 0.25 if c.ratio is None else 0.25 + 0.75 * min(1.0, math.log(c.ratio) / math.log(3))
                color = COLORS.get(c.winner, "lightgrey")
                axis.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=color, edgecolor="white",
                                             alpha=shade if c.winner else 1.0))
                if c.winner is None:
                    label = "no winner\n(same end of\nthe rates)"
                else:
                    best = c.best[c.winner]
                    label = f"{c.winner}\n{c.ratio_bound}{c.ratio:.2f}x\n{best.bound}{best.value:.2g} /s/GPU"
                    label += f"\n({best.system})" if c.winner == "disaggregated" else ""
                axis.text(x, y, label, ha="center", va="center", fontsize=7.5)
            axis.set_xticks(range(len(workloads)))
            axis.set_xticklabels(workloads)
            axis.set_yticks(range(len(scales)))
            axis.set_yticklabels([f"{s} ({self.slo_scales[s]:g}x)" for s in scales])
            gpus = {sum(devices(r).values()) for r in rows if setup_name(r, SCENARIO).startswith(model + "-")}
            axis.set_title(f"{model}, {'/'.join(map(str, sorted(gpus)))} GPUs per design", fontsize=9)
            axis.set_xlabel("length ratio")
        axes[0][0].legend(handles=[Patch(color=COLORS[d], label=DESIGNS[d]) for d in DESIGNS], loc="upper left",
                          bbox_to_anchor=(0.0, -0.22), ncol=len(DESIGNS), fontsize=8, frameon=False)
        fig.suptitle("winner of per-GPU goodput at 90% SLO attainment; shade and number: margin over the runner-up",
                     fontsize=9)
        save_figure(fig, path)
