"""Sweep plots: throughput-latency curves over request rates and TBT CDFs (matplotlib)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Any) -> None:
    """Lay out ``fig``, write it to ``path`` (PNG, 120 dpi) and release it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def plot_throughput_latency(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Output throughput (x) against P99 TBT and P50 TTFT (y), one line per group of jobs
    that differ only in ``workload.rate`` (points in rate order, labelled with the rate)."""
    plt = _pyplot()
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["job"]["group"]].append(row)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, members in groups.items():
        members.sort(key=lambda r: r["workload"]["rate"] or 0.0)
        x = [r["output_throughput"] for r in members]
        for axis, metric in zip(axes, ("itl_ms", "ttft_ms")):
            y = [r[metric]["p99" if metric == "itl_ms" else "p50"] for r in members]
            axis.plot(x, y, marker="o", label=name or "default")
            for r, xi, yi in zip(members, x, y):
                if r["workload"]["rate"] is not None and yi is not None:
                    axis.annotate(f"{r['workload']['rate']:g}/s", (xi, yi), fontsize=7,
                                  textcoords="offset points", xytext=(3, 3))
    for axis, title in zip(axes, ("P99 time between tokens (ms)", "P50 time to first token (ms)")):
        axis.set_xlabel("output throughput (tokens/s)")
        axis.set_ylabel(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("throughput vs latency (labels: request rate)")
    save_figure(fig, path)


def plot_tbt_cdf(labelled_gaps: Sequence[tuple[str, Sequence[float]]], path: str) -> None:
    """Empirical CDF of every time between tokens (ms), one line per job."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(6.5, 4.2))
    for label, gaps in labelled_gaps:
        if not gaps:
            continue
        ordered = sorted(gaps)
        n = len(ordered)
        points = [(x, (i + 1) / n) for i, x in enumerate(ordered) if x > 0]  # zero gaps (one step's tokens) stay counted
        axis.step([x for x, _ in points], [y for _, y in points], where="post", label=label)
    axis.set_xscale("log")
    axis.set_xlabel("time between tokens (ms, log scale)")
    axis.set_ylabel("fraction of gaps")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    save_figure(fig, path)
