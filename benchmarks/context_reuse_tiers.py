"""The table and plot of a context-reuse sweep over KV tiers (docs/results/context_reuse.md).

Reads the ``rows.jsonl`` that ``servelab-bench -m`` writes in each sweep folder given and
prints one markdown row per job (its tiers, prefix index and eviction policy; overall and
later-turn prefix hit rate, later-turn TTFT P50/P99, evicted blocks, tokens found in each
tier, request throughput); ``--plot`` draws the later turns' hit rate and TTFT P50 per job.

    python benchmarks/context_reuse_tiers.py multirun/bench/<date>/<time> [...] --plot tiers.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def setting(row: dict[str, Any], key: str, default: str) -> str:
    """The value a job's overrides gave ``key`` (``default`` when none did)."""
    for override in row["job"]["overrides"]:
        name, _, value = override.partition("=")
        if name == key:
            return value
    return default


def tiers(row: dict[str, Any]) -> str:
    """The tiers below the device, e.g. ``host 1 MiB + disk 64 MiB``."""
    host = int(float(setting(row, "cache.host_cache_bytes", "0")))
    lower = setting(row, "cache.lower_tier", "null")
    parts = [f"host {host / 2 ** 20:g} MiB"] if host else []
    if lower not in ("null", "None", ""):
        parts.append(f"{lower} {int(float(setting(row, 'cache.lower_tier_bytes', '0'))) / 2 ** 20:g} MiB")
    return " + ".join(parts) or "device only"


def label(row: dict[str, Any]) -> str:
    """Tiers, index and eviction of a job."""
    return f"{tiers(row)}, {setting(row, 'cache.prefix_index', 'hash')}, {setting(row, 'cache.eviction', 'lru')}"


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per job."""
    lines = ["| tiers | index | eviction | prefix hit % | later-turn hit % | later-turn TTFT p50 ms "
             "| later-turn TTFT p99 ms | evicted blocks | tokens from tiers | req/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        later = row["sessions"]["later_turns"]
        found = row["system"].get("tier_hit_tokens") or {}
        lines.append(
            f"| {tiers(row)} | {setting(row, 'cache.prefix_index', 'hash')} | {setting(row, 'cache.eviction', 'lru')} "
            f"| {100 * (row['prefix_cache_hit_rate'] or 0):.1f} | {100 * (later['prefix_cache_hit_rate'] or 0):.1f} "
            f"| {later['ttft_ms']['p50']:.1f} | {later['ttft_ms']['p99']:.1f} "
            f"| {row['system'].get('prefix_evicted_blocks', 0)} "
            f"| {', '.join(f'{tier} {count}' for tier, count in found.items()) or '-'} "
            f"| {row['request_throughput']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Later turns' prefix hit rate and TTFT P50 per job, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(row) for row in rows]
    later = [row["sessions"]["later_turns"] for row in rows]
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    hits.barh(names, [100 * (part["prefix_cache_hit_rate"] or 0) for part in later], color="tab:blue")
    hits.set_xlabel("later-turn prefix hit %")
    hits.invert_yaxis()
    ttft.barh(names, [part["ttft_ms"]["p50"] for part in later], color="tab:orange")
    ttft.set_xlabel("later-turn TTFT P50 (ms)")
    figure.suptitle("multi_turn on a 40-block device cache: tiers x index x eviction")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders holding rows.jsonl")
    parser.add_argument("--plot", type=Path, help="write the plot here")
    args = parser.parse_args()
    rows = [json.loads(line) for sweep in args.sweeps for line in (sweep / "rows.jsonl").read_text().splitlines()
            if line.strip()]
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
