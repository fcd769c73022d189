"""CachedAttention / AttentionStore (Gao et al., USENIX ATC 2024): multi-turn conversations
whose KV caches wait below the GPU between turns instead of being recomputed, servelab
beside the paper's claims.

Each job of ``experiment=cached_attention`` is one cache setup
(``+experiment/cached_attention_cache``: ``recompute``, ``device``, ``host``) over the same
conversations. Prefill throughput here is a later turn's prompt tokens over its time to
first token (means over later turns): the rate at which a turn's context becomes ready.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.paper_radix_attention import ratio
from servelab.bench.paper_report import PaperReport
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import setup_name

CACHE = "experiment/cached_attention_cache"
"""The config group that names a job's cache setup."""

SETUPS = ("recompute", "device", "host")
"""The setups in table order; the first is the baseline."""

PAPER = {"ttft_cut": "up to 87%", "prefill_gain": "up to 7.8x", "cost_cut": "up to 70%"}
"""The paper's headline against recomputation (its Section 5)."""


def by_setup(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows by cache setup, in ``SETUPS`` order."""
    found = {setup_name(row, CACHE): row for row in rows}
    return {name: found[name] for name in SETUPS if name in found}


def later(row: dict[str, Any]) -> dict[str, Any]:
    """Later turns' TTFT (ms), mean prompt tokens, hit rate and prefill throughput (tok/s)."""
    part = row["sessions"]["later_turns"]
    ttft = part["ttft_ms"]
    return {"ttft_ms": ttft, "hit_rate": part["prefix_cache_hit_rate"] or 0.0, "prompt": part["mean_prompt_tokens"],
            "prefill_tps": ratio(1000 * part["mean_prompt_tokens"], ttft["mean"])}


class CachedAttentionReport(PaperReport):
    """``experiment=cached_attention``'s comparison (``paper.md``, ``paper.png``)."""

    title = "KV caches kept across turns (CachedAttention) against recomputation"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per setup: later turns' TTFT and its cut, prefill throughput and its gain, hit
        rate; throughput, evicted blocks, preemptions; the paper's headline under it."""
        found = by_setup(rows)
        base = later(found["recompute"]) if "recompute" in found else None
        header = ["setup", "requests", "later TTFT mean ms", "p50 ms", "p99 ms", "TTFT cut %", "prefill tok/s",
                  "vs recompute", "later hit %", "req/s", "evicted blocks", "preemptions"]
        body = []
        for name, row in found.items():
            view = later(row)
            cut = ratio(view["ttft_ms"]["mean"], base["ttft_ms"]["mean"]) if base else None
            body.append([name, row["num_completed"], view["ttft_ms"]["mean"], view["ttft_ms"]["p50"],
                         view["ttft_ms"]["p99"], None if cut is None else 100 * (1 - cut), view["prefill_tps"],
                         ratio(view["prefill_tps"], base["prefill_tps"]) if base else None, 100 * view["hit_rate"],
                         row["request_throughput"], row["system"].get("prefix_evicted_blocks"), row["preemptions"]])
        return (render_markdown(header, body, "lrrrrrrrrrrr") + "\n"
                + f"The paper, against recomputation: TTFT {PAPER['ttft_cut']} lower, prefill throughput "
                + f"{PAPER['prefill_gain']}, cost {PAPER['cost_cut']} lower (host memory and disks).\n")

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Later turns' TTFT (mean, p50, p99) and hit rate per setup."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        found = by_setup(rows)
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
        names = list(found)
        for i, stat in enumerate(("mean", "p50", "p99")):
            left.bar([x + 0.27 * i for x in range(len(names))], [later(found[n])["ttft_ms"][stat] for n in names],
                     0.27, label=stat)
        right.bar(range(len(names)), [100 * later(found[n])["hit_rate"] for n in names])
        left.set_yscale("log")
        left.set_ylabel("later-turn TTFT (ms)")
        left.legend(fontsize=8)
        right.set_ylabel("later-turn prefix hit %")
        for axis, offset in ((left, 0.27), (right, 0.0)):
            axis.set_xticks([x + offset for x in range(len(names))], names)
            axis.grid(alpha=0.3, axis="y")
        save_figure(fig, path)
