"""DistServe (Zhong et al., OSDI 2024): per-GPU goodput of disaggregated prefill and decode
against colocated vLLM, servelab's simulation beside the paper.

Goodput is the highest per-GPU request rate at which 90% of requests meet both the TTFT
and the TPOT objective. Each job of ``experiment=distserve`` is one setup
``+experiment/distserve_setup=MODEL-SYSTEM`` (``vllm``: one mixed engine, continuous
batching; ``XpYd``: X prefill and Y decode instances) at one ``workload.rate``. The
tighter-SLO comparison takes, at each per-GPU rate a disaggregated system and vLLM both
ran, the smallest scale of both objectives that 90% of requests still meet (the 90th
percentile of each request's max(TTFT / TTFT SLO, TPOT / TPOT SLO), from ``samples.json``).
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
         "12.6x tighter SLOs than vLLM, over OPT-13B/66B/175B and chatbot, code and summarization workloads")


def by_setup(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Jobs by model, then system."""
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        model, system = setup_name(row, GROUP).rsplit("-", 1)
        found.setdefault(model, {}).setdefault(system, []).append(row)
    return found


def gpus(row: dict[str, Any]) -> int:
    """Devices the job used, every kind together."""
    return sum(devices(row).values())


def slo_scale(row: dict[str, Any], target: float = 0.9) -> float | None:
    """The smallest factor on both objectives that ``target`` of the job's requests meet;
    None when its samples do not pair TTFT with TPOT (a request of one output token)."""
    samples = json.loads((Path(row["job"]["dir"]) / "samples.json").read_text())
    ttft, tpot = samples["ttft_ms"], samples["tpot_ms"]
    slo = job_config(row).slo
    if not ttft or len(ttft) != len(tpot):
        return None
    return percentile([max(a / slo.ttft_ms, b / slo.tpot_ms) for a, b in zip(ttft, tpot)], 100 * target)


class DistServeReport(PaperReport):
    """``experiment=distserve``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Disaggregated prefill and decode against DistServe"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per setup: devices, per-GPU goodput at 90% attainment and the gain over vLLM;
        then the SLO scales at the per-GPU rates both systems ran."""
        body, scales = [], []
        for model, systems in by_setup(rows).items():
            goodput = {}
            for system, runs in systems.items():
                count = gpus(runs[0])
                rate, bound = rate_at_attainment(curve(runs))
                goodput[system] = None if rate is None else rate / count
                body.append([model, system, count, cell(goodput[system], bound), runs[0]["system"]["name"]])
            base = goodput.get("vllm")
            for line in body[-len(systems):]:
                value = goodput[line[1]]
                line.append(f"{value / base:.2f}x" if value is not None and base else "-")
            per_gpu = {system: {round(r["workload"]["rate"] / gpus(r), 6): r for r in runs}
                       for system, runs in systems.items()}
            for system in (s for s in per_gpu if s != "vllm" and "vllm" in per_gpu):
                for rate in sorted(set(per_gpu["vllm"]) & set(per_gpu[system])):
                    v, d = slo_scale(per_gpu["vllm"][rate]), slo_scale(per_gpu[system][rate])
                    scales.append([model, system, rate, v, d, f"{v / d:.2f}x" if v and d else "-"])
        text = render_markdown(["model", "system", "GPUs", "goodput req/s/GPU (90% SLO)", "servelab system",
                                "vs vLLM"], body, "llrrlr")
        if scales:
            text += "\n" + render_markdown(["model", "system", "req/s/GPU", "vLLM SLO scale (90%)",
                                            "its SLO scale (90%)", "tighter by"], scales, "llrrrr")
        curves = ["", "Every job (rate req/s: SLO attainment):", ""]
        for model, systems in by_setup(rows).items():
            for system, runs in systems.items():
                curves.append(f"- {model}-{system}: " + ", ".join(f"{r:.3g}: {100 * a:.1f}%" for r, a in curve(runs)))
        return text + "\n".join(curves) + f"\n\nPaper: {PAPER}.\n"

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """SLO attainment against per-GPU rate, one line per setup, the 90% target dashed."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        fig, axis = plt.subplots(figsize=(6.5, 4.2))
        for model, systems in by_setup(rows).items():
            for system, runs in systems.items():
                count = gpus(runs[0])
                points = curve(runs)
                axis.plot([r / count for r, _ in points], [100 * a for _, a in points], marker="o",
                          label=f"{model} {system} ({count} GPUs)")
        axis.axhline(90, linestyle="--", color="grey")
        axis.set_xlabel("request rate per GPU (req/s)")
        axis.set_ylabel("SLO attainment (%)")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
        save_figure(fig, path)
