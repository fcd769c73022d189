"""Fairness in Serving LLMs (Sheng et al., OSDI 2024): the Virtual Token Counter against
first come, first served and request-count fairness, servelab beside the paper's claims.

Each job of ``experiment=vtc`` is one policy (``+experiment/vtc_policy=...``) over the same
two-tenant workload; service is counted in the load window (bench/tenant_metrics.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import setup_name

PAPER_CLAIMS = {
    "fcfs": "service proportional to send rate; the light client waits behind the heavy one",
    "vtc": "backlogged clients within 2U of equal service; a client under its share gets all it asks, fast",
    "requests": "equal requests, unequal tokens when lengths differ",
}
"""What the paper shows for each policy (its Figures 3, 4, 7, 8 and Section 5.2; no table of numbers)."""


def by_policy(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows by ``vtc_policy`` setup (``fcfs``, ``vtc``, ``requests``), in that order."""
    found = {setup_name(row, "experiment/vtc_policy"): row for row in rows}
    return {name: found[name] for name in PAPER_CLAIMS if name in found}


class VtcReport(PaperReport):
    """``experiment=vtc``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Fair sharing between tenants against the VTC paper"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per policy and tenant: send rate, service received and its share, latency; per
        policy: the service difference, Jain's index and the paper's claim."""
        found = by_policy(rows)
        header = ["policy", "tenant", "sends req/s", "requests", "service tok/s", "share %", "TTFT p50 ms",
                  "TTFT p99 ms", "TPOT p99 ms"]
        body = []
        for policy, row in found.items():
            tenants = row["tenants"]
            total = sum(t["service_tokens_per_s"] or 0.0 for t in tenants.values())
            for name, tenant in tenants.items():
                body.append([policy, name, row["workload"]["tenants"][name], tenant["requests"],
                             tenant["service_tokens_per_s"], 100 * (tenant["service_tokens_per_s"] or 0.0) / total,
                             tenant["ttft_ms"]["p50"], tenant["ttft_ms"]["p99"], tenant["tpot_ms"]["p99"]])
        text = render_markdown(header, body, "llrrrrrrr")
        summary = [[policy, row["fairness"]["service_difference_per_s"], row["fairness"]["jain"],
                    row["fairness"]["window_s"], PAPER_CLAIMS[policy]] for policy, row in found.items()]
        return text + "\n" + render_markdown(["policy", "service difference tok/s", "Jain", "load window s",
                                              "the paper"], summary, "lrrrl")

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Each tenant's service rate over the load window, one panel per policy."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        found = by_policy(rows)
        fig, axes = plt.subplots(1, max(1, len(found)), figsize=(4 * max(1, len(found)), 3.4), sharey=True,
                                 squeeze=False)
        for axis, (policy, row) in zip(axes[0], found.items()):
            bucket = row["fairness"]["timeline_bucket_s"]
            for name, series in row["fairness"]["timeline"].items():
                axis.plot([bucket * (i + 0.5) for i in range(len(series))], series, marker="o", label=name)
            axis.set_title(f"{policy} (Jain {row['fairness']['jain']:.3f})")
            axis.set_xlabel("time (s)")
            axis.grid(alpha=0.3)
        axes[0][0].set_ylabel("service (prompt + 2 x output tokens/s)")
        axes[0][0].legend(fontsize=8)
        save_figure(fig, path)
