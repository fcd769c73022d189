"""S-LoRA (Sheng et al., MLSys 2024), *S-LoRA: Serving Thousands of Concurrent LoRA
Adapters*: batched multi-adapter serving against merging one adapter at a time, throughput
against the number of adapters.

Each job of ``experiment=slora`` is one way of serving (``+experiment/slora_serving=
batched | merged``) at one ``workload.num_adapters``. The report puts, per number of
adapters, each system's throughput (requests/s), the batched system's over the merged
one's, each one's adapter hit rate and load time, and S-LoRA's published throughputs for its
setting S2 (``PAPER``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport, job_config
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import setup_name

GROUP = "experiment/slora_serving"
PAPER = {5: (7.485, 0.87), 100: (7.29, 0.243), 2000: (6.727, None)}
"""S-LoRA's measurements behind its throughput table, setting S2 (Llama-7B, ranks
64/32/16/8, one A100-80GB, 10 requests/s for 120 s): requests/s of S-LoRA and of
HuggingFace PEFT (which swaps one adapter in at a time; None: not measured) by number of
adapters, as the authors' repository publishes them (S-LoRA/S-LoRA,
``benchmarks/paper/synthetic/slora/synthetic_num_adapters_a100-80_S2_slora_table.jsonl``
and ``benchmarks/paper/peft/num_adapter_a100-80_S2_peft_fig3.jsonl``)."""


def entries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per number of adapters: each system's throughput and paging."""
    by_count: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_count[int(job_config(row).workload.num_adapters)][setup_name(row, GROUP)] = row
    out = []
    for count, setups in sorted(by_count.items()):
        batched, merged = setups.get("batched"), setups.get("merged")
        paper = PAPER.get(count, (None, None))
        entry = {"adapters": count, "paper_slora": paper[0], "paper_peft": paper[1],
                 "ratio": batched["request_throughput"] / merged["request_throughput"] if batched and merged else None}
        for name, row in (("batched", batched), ("merged", merged)):
            lora = (row or {}).get("system", {}).get("lora", {})
            entry[name] = row["request_throughput"] if row else None
            entry[f"{name}_hit_rate"], entry[f"{name}_load_ms"] = lora.get("hit_rate"), lora.get("load_ms")
        out.append(entry)
    return out


def _percent(rate: float | None) -> float | None:
    """A rate as a percentage (None stays None)."""
    return None if rate is None else 100 * rate


class SLoRAReport(PaperReport):
    """``experiment=slora``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Serving many LoRA adapters: S-LoRA (MLSys'24)"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per number of adapters: batched and merged requests/s, their ratio, each
        system's adapter hit rate and load time, and S-LoRA's S2 numbers."""
        header = ["adapters", "batched req/s", "merged req/s", "batched / merged", "batched hit %", "batched load ms",
                  "merged hit %", "merged load ms", "paper: S-LoRA req/s", "paper: PEFT req/s"]
        body = [[e["adapters"], e["batched"], e["merged"], e["ratio"], _percent(e["batched_hit_rate"]),
                 e["batched_load_ms"], _percent(e["merged_hit_rate"]), e["merged_load_ms"],
                 *("-" if e[key] is None else e[key] for key in ("paper_slora", "paper_peft"))] for e in entries(rows)]
        return render_markdown(header, body, "rrrrrrrrrr")

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Throughput against the number of adapters, ours and the paper's."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        fig, axis = plt.subplots(figsize=(6.5, 4.2))
        data = entries(rows)
        for key, label, marker in (("batched", "servelab batched (simulated)", "o"),
                                   ("merged", "servelab merge one at a time (simulated)", "s"),
                                   ("paper_slora", "S-LoRA, paper (S2)", "^"), ("paper_peft", "PEFT, paper (S2)", "v")):
            points = [(e["adapters"], e[key]) for e in data if e[key] is not None]
            if points:
                axis.plot(*zip(*points), marker=marker, label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("LoRA adapters")
        axis.set_ylabel("throughput (requests/s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        save_figure(fig, path)
