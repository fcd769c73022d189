"""SGLang's RadixAttention (Zheng et al., NeurIPS 2024): KV cache reuse across requests
against a cache without it, on few-shot prompts, multi-turn chats and agent loops,
servelab beside the paper's claims.

Each job of ``experiment=radix_attention`` is one workload
(``+experiment/radix_attention_workload``) under one cache (``+experiment/radix_attention_cache``:
``off``, ``hash``, ``radix``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import setup_name

WORKLOAD = "experiment/radix_attention_workload"
CACHE = "experiment/radix_attention_cache"
"""The config groups that name a job's workload and cache."""

PAPER_CLAIMS = {
    "few_shot": "5-shot MMLU, 20-shot HellaSwag: the largest gains (up to 6.4x over vLLM without reuse, Figure 5)",
    "multi_turn": "multi-turn chat: gains grow with the history (long chats more than short, Figure 5)",
    "agentic": "ReAct and generative agents: faster with reuse (Figure 5)",
}
"""What the paper shows per workload kind (Llama-7B on an A10G; its whole system against
vLLM, Guidance and LMQL; hit rates 50-99% over its workloads)."""


def grid(rows: list[dict[str, Any]], row_group: str, column_group: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Rows by the option of ``row_group``, then of ``column_group``, in job order."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        found.setdefault(setup_name(row, row_group), {})[setup_name(row, column_group)] = row
    return found


def reuse_view(row: dict[str, Any]) -> dict[str, Any]:
    """TTFT and prefix hit rate where reuse can happen: later turns of a closed-loop
    workload (a session's first request finds little), every request otherwise."""
    later = (row.get("sessions") or {}).get("later_turns")
    part = later if later and later["num_requests"] else row
    return {"ttft_ms": part["ttft_ms"], "hit_rate": part["prefix_cache_hit_rate"] or 0.0}


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; None when either is missing or ``base`` is 0."""
    return value / base if value is not None and base else None


class RadixAttentionReport(PaperReport):
    """``experiment=radix_attention``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Prefix reuse (RadixAttention) against no reuse"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per workload and cache: requests, throughput and its gain over ``off``, TTFT,
        prefix hit rate, evicted blocks and preemptions; the paper's claim per workload."""
        header = ["workload", "cache", "requests", "req/s", "total tok/s", "vs off", "TTFT p50 ms", "TTFT p99 ms",
                  "prefix hit %", "evicted blocks", "preemptions"]
        body = []
        for workload, caches in grid(rows, WORKLOAD, CACHE).items():
            base = caches.get("off", {}).get("request_throughput")
            for cache, row in caches.items():
                view = reuse_view(row)
                body.append([workload, cache, row["num_completed"], row["request_throughput"],
                             row["total_token_throughput"], ratio(row["request_throughput"], base),
                             view["ttft_ms"]["p50"], view["ttft_ms"]["p99"], 100 * view["hit_rate"],
                             row["system"].get("prefix_evicted_blocks"), row["preemptions"]])
        claims = [[name, claim] for name, claim in PAPER_CLAIMS.items()]
        return (render_markdown(header, body, "llrrrrrrrrr") + "\n"
                + "TTFT and hit rate: later turns for multi_turn and agentic.\n\n"
                + render_markdown(["workload", "the paper"], claims, "ll"))

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Throughput relative to ``off`` and the prefix hit rate, per workload and cache."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        found = grid(rows, WORKLOAD, CACHE)
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
        caches = list(dict.fromkeys(cache for by_cache in found.values() for cache in by_cache))
        width = 0.8 / max(1, len(caches))
        for i, cache in enumerate(caches):
            xs = [w + i * width for w in range(len(found))]
            gains = [ratio(c[cache]["request_throughput"], c.get("off", {}).get("request_throughput")) or 0.0
                     if cache in c else 0.0 for c in found.values()]
            hits = [100 * reuse_view(c[cache])["hit_rate"] if cache in c else 0.0 for c in found.values()]
            left.bar(xs, gains, width, label=cache)
            right.bar(xs, hits, width, label=cache)
        for axis, label in ((left, "throughput / off"), (right, "prefix hit %")):
            axis.set_xticks([w + 0.4 - width / 2 for w in range(len(found))], list(found))
            axis.set_ylabel(label)
            axis.grid(alpha=0.3, axis="y")
        left.legend(fontsize=8)
        save_figure(fig, path)
