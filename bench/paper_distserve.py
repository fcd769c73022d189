"""DistServe (Zhong et al., OSDI 2024): per-GPU goodput of disaggregated prefill and decode
against colocated vLLM, servelab's simulation beside the paper.

Goodput is the highest per-GPU request rate at which 90% of requests meet both the TTFT
and the TPOT objective. Each job of ``experiment=distserve`` is one setup
``+experiment/distserve_setup=CELL-SYSTEM`` (a cell is a model and a workload,
``opt-66b-code``; a system is ``vllm``, one mixed engine, or a disaggregated placement,
``distserve`` or ``XpYd``) at one ``+distserve.load``, a multiple of the cell's per-GPU base
rate, so every system of a cell runs the same per-GPU rates. The tighter-SLO comparison
takes, at each per-GPU rate a disaggregated system and vLLM both ran, the smallest scale of
both objectives that 90% of requests still meet (the 90th percentile of each request's
max(TTFT / TTFT SLO, TPOT / TPOT SLO), from ``samples.json``); the headline is the one at
the highest such rate where vLLM meets the objectives unscaled (its scale at most 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelab.bench.metrics import percentile
from servelab.bench.paper_report import PaperReport, job_config
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import cell, curve, devices, rate_at_attainment, setup_name

GROUP = "experiment/distserve_setup"
PAPER = ("DistServe serves up to 7.4x more requests (per GPU, at 90% SLO attainment) or meets "
         "12.6x tighter SLOs than state-of-the-art systems (the 7.4x against DeepSpeed-MII), over OPT-13B/66B/175B "
         "and chatbot, code and summarization workloads")
PAPER_GAINS = {"chatbot": ("2.0-4.6x", "1.8-3.2x"), "code": ("5.7x", "1.4x"), "summarization": ("4.3x", "12.6x")}
"""The paper's gains over vLLM per application, (per-GPU rate, SLO scale), §6.2 as two
summaries of it state them; the chatbot ranges span OPT-13B, 66B and 175B."""


def by_setup(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Jobs by cell (model and workload), then system, in the order they ran."""
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in sorted(rows, key=lambda r: r["job"]["num"]):
        model, system = setup_name(row, GROUP).rsplit("-", 1)
        found.setdefault(model, {}).setdefault(system, []).append(row)
    return found


def gpus(row: dict[str, Any]) -> int:
    """Devices the job used, every kind together."""
    return sum(devices(row).values())


def placement(row: dict[str, Any]) -> str:
    """How the job split the model: ``TP4`` for one engine, ``1x TP4 + 1x TP2xPP2`` for
    prefill + decode pools."""
    def split(instances: int, tp: int, pp: int) -> str:
        return f"{instances}x TP{tp}" + (f"xPP{pp}" if pp > 1 else "")

    pools = row["system"].get("pools")
    if pools:
        return " + ".join(split(p["instances"], p["tensor_parallel_size"], p["pipeline_parallel_size"])
                          for p in (pools["prefill"], pools["decode"]))
    par = job_config(row).parallel
    return split(1, par.tensor_parallel_size, par.pipeline_parallel_size)[3:]


def slo_scale(row: dict[str, Any], target: float = 0.9) -> float | None:
    """The smallest factor on both objectives that ``target`` of the job's requests meet;
    None when its samples do not pair TTFT with TPOT (a request of one output token)."""
    samples = json.loads((Path(row["job"]["dir"]) / "samples.json").read_text())
    ttft, tpot = samples["ttft_ms"], samples["tpot_ms"]
    slo = job_config(row).slo
    if not ttft or len(ttft) != len(tpot):
        return None
    return percentile([max(a / slo.ttft_ms, b / slo.tpot_ms) for a, b in zip(ttft, tpot)], 100 * target)


def paper_gain(cell_name: str, index: int) -> str:
    """The paper's gain over vLLM for a cell's application (0: rate, 1: SLO scale)."""
    return next((gains[index] for app, gains in PAPER_GAINS.items() if cell_name.endswith(app)), "-")


def per_gpu_curve(runs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(rate per GPU, SLO attainment)`` of a system's jobs, by rate."""
    count = gpus(runs[0])
    return [(rate / count, attainment) for rate, attainment in curve(runs)]


def ratio(goodput: tuple[float | None, str], base: tuple[float | None, str]) -> str:
    """``goodput / base`` as ``2.10x``, marked when either end lies beyond the swept rates
    (``>=``, ``<``, ``<=``, ``>``; ``~`` when both do)."""
    (value, bound), (reference, reference_bound) = goodput, base
    if value is None or not reference:
        return "-"
    mark = {("", ""): "", (">=", ""): ">= ", ("<", ""): "< ", ("", ">="): "<= ", ("", "<"): "> "}.get(
        (bound, reference_bound), "~ ")
    return f"{mark}{value / reference:.2f}x"


def per_gpu_runs(runs: list[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    """A system's jobs by per-GPU rate."""
    return {round(r["workload"]["rate"] / gpus(r), 6): r for r in runs}


def scale_rows(cell_name: str, systems: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    """``[cell, system, req/s/GPU, vLLM scale, its scale, ratio]`` at every per-GPU rate
    a disaggregated system and vLLM both ran."""
    if "vllm" not in systems:
        return []
    base = {rate: slo_scale(row) for rate, row in per_gpu_runs(systems["vllm"]).items()}
    lines = []
    for system, runs in systems.items():
        if system == "vllm":
            continue
        for rate, row in sorted(per_gpu_runs(runs).items()):
            if rate in base:
                v, d = base[rate], slo_scale(row)
                lines.append([cell_name, system, rate, v, d, v / d if v and d else None])
    return lines


def headline_scale(lines: list[list[Any]], system: str) -> str:
    """A system's tighter-SLO factor at the highest per-GPU rate where vLLM's scale is at
    most 1, as ``1.3x at 2``."""
    fit = [line for line in lines if line[1] == system and line[3] is not None and line[3] <= 1 and line[5]]
    return f"{fit[-1][5]:.2f}x at {fit[-1][2]:g}" if fit else "-"


class DistServeReport(PaperReport):
    """``experiment=distserve``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Disaggregated prefill and decode against DistServe"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per cell and system: GPUs, placement, SLOs, per-GPU goodput at 90% attainment,
        the gain over vLLM and the tighter SLO beside the paper's; then the SLO scales at
        every per-GPU rate both systems ran, and every job's attainment."""
        body, scales = [], []
        for cell_name, systems in by_setup(rows).items():
            lines = scale_rows(cell_name, systems)
            scales += lines
            goodput = {system: rate_at_attainment(per_gpu_curve(runs)) for system, runs in systems.items()}
            base = goodput.get("vllm", (None, ""))
            for system, runs in systems.items():
                slo = job_config(runs[0]).slo
                vllm = system == "vllm"
                body.append([cell_name, system, gpus(runs[0]), placement(runs[0]),
                             f"{slo.ttft_ms / 1000:g} / {slo.tpot_ms / 1000:g}", cell(*goodput[system]),
                             "1.00x" if vllm else ratio(goodput[system], base),
                             "" if vllm else paper_gain(cell_name, 0),
                             "" if vllm else headline_scale(lines, system), "" if vllm else paper_gain(cell_name, 1)])
        text = render_markdown(["cell", "system", "GPUs", "placement", "TTFT / TPOT SLO s",
                                "goodput req/s/GPU (90% SLO)", "vs vLLM", "paper vs vLLM",
                                "tighter SLO (at req/s/GPU)", "paper tighter SLO"], body, "llrllrrrrr")
        if scales:
            text += "\nSLO scale that 90% of requests meet, at each per-GPU rate both ran:\n\n" + render_markdown(
                ["cell", "system", "req/s/GPU", "vLLM SLO scale (90%)", "its SLO scale (90%)", "tighter by"],
                [[c, s, f"{r:g}", f"{v:.3g}" if v else "-", f"{d:.3g}" if d else "-", f"{x:.2f}x" if x else "-"]
                 for c, s, r, v, d, x in scales], "llrrrr")
        curves = ["", "Every job (req/s/GPU: SLO attainment):", ""]
        for cell_name, systems in by_setup(rows).items():
            for system, runs in systems.items():
                curves.append(f"- {cell_name}-{system}: "
                              + ", ".join(f"{r:.3g}: {100 * a:.1f}%" for r, a in per_gpu_curve(runs)))
        return text + "\n".join(curves) + f"\n\nPaper: {PAPER}.\n"

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """SLO attainment against per-GPU rate, one panel per cell, one line per system,
        the 90% target dashed."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        cells = by_setup(rows)
        fig, axes = plt.subplots(1, len(cells), figsize=(3.6 * len(cells), 3.4), squeeze=False)
        for axis, (cell_name, systems) in zip(axes[0], cells.items()):
            for system, runs in systems.items():
                points = per_gpu_curve(runs)
                axis.plot([r for r, _ in points], [100 * a for _, a in points], marker="o",
                          label=f"{system} ({gpus(runs[0])} GPUs)")
            axis.axhline(90, linestyle="--", color="grey")
            axis.set_title(cell_name, fontsize=9)
            axis.set_xlabel("request rate per GPU (req/s)")
            axis.set_ylim(0, 105)
            axis.legend(fontsize=7)
            axis.grid(alpha=0.3)
        axes[0][0].set_ylabel("SLO attainment (%)")
        save_figure(fig, path)
