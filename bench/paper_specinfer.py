"""SpecInfer (Miao et al., ASPLOS 2024), *Accelerating Large Language Model Serving with
Tree-based Speculative Inference and Verification*: a token tree against one chain at equal
verified tokens per step, and both against incremental decoding.

The paper reports 1.5-2.8x lower latency than incremental decoding for distributed
inference (2.6-3.5x with offloading), and that its token trees verify more tokens per step
than one speculated sequence. Each job of ``experiment=specinfer`` is one setup
(``+experiment/specinfer_setup=incremental | chainN | treeN``) at one batch size; the
report puts, per batch size and node count N, the tokens per step the acceptance table
predicts (``TreeAcceptance.expected_kept``), the simulated ones, the mean TPOT and
end-to-end latency, and the speed-up over incremental decoding.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from servelab.bench.paper_report import PaperReport, job_config
from servelab.bench.report import render_markdown
from servelab.bench.slo_goodput import setup_name
from servelab.plugins.executor.simulated_tree import TreeAcceptance, tree_shape

GROUP = "experiment/specinfer_setup"
PAPER_SPEEDUP = "1.5-2.8x"
"""SpecInfer's latency reduction over incremental decoding, distributed inference (abstract)."""


def verified_nodes(row: dict[str, Any]) -> int:
    """Draft tokens the target verifies per step in the job: the tree's nodes or the chain's k."""
    decoding = job_config(row).decoding
    return len(decoding.tree) if decoding.tree else int(decoding.num_speculative_tokens)


def expected_tokens(row: dict[str, Any]) -> float:
    """Tokens per target step the job's acceptance table predicts: 1 + the expected kept
    path of its tree (a chain: the table's rank-0 column)."""
    cfg = job_config(row)
    acceptance = TreeAcceptance(cfg.executor.tree_acceptance)
    shape = tree_shape(cfg.decoding, acceptance)
    paths = shape[0] if shape else [(0,) * d for d in range(1, int(cfg.decoding.num_speculative_tokens) + 1)]
    return 1.0 + acceptance.expected_kept(paths)


def entries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (batch size, setup), sorted by batch, node count, chain before tree."""
    by_batch: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_batch[int(job_config(row).scheduler.max_num_seqs)][setup_name(row, GROUP)] = row
    out = []
    for batch, setups in sorted(by_batch.items()):
        base = setups.get("incremental")
        for name, row in sorted(setups.items(), key=lambda item: (verified_nodes(item[1]), item[0])):
            nodes = verified_nodes(row)
            tokens = 1.0 + nodes * (row["spec_acceptance_rate"] or 0.0)
            chain = setups.get(f"chain{nodes}")
            out.append({
                "batch": batch, "setup": name, "nodes": nodes, "expected": expected_tokens(row), "tokens": tokens,
                "tpot_ms": row["tpot_ms"]["mean"], "e2e_ms": row["e2e_ms"]["mean"],
                "speedup": base["tpot_ms"]["mean"] / row["tpot_ms"]["mean"] if base else None,
                "vs_chain": chain["tpot_ms"]["mean"] / row["tpot_ms"]["mean"] if chain and name.startswith("tree")
                else None})
    return out


class SpecInferReport(PaperReport):
    """``experiment=specinfer``'s comparison (``paper.md``, ``paper.png``)."""

    title = "Token trees against chains: SpecInfer (ASPLOS'24)"

    def table(self, rows: list[dict[str, Any]]) -> str:
        """Per batch and setup: verified nodes, tokens per step (table's expectation and
        simulated), TPOT, E2E latency, TPOT speed-up over incremental (the paper: 1.5-2.8x) and
        the tree's over the chain of as many nodes."""
        header = ["batch", "setup", "verified drafts / step", "tokens / step expected", "tokens / step simulated",
                  "TPOT ms", "E2E ms", "TPOT speed-up vs incremental", f"paper ({PAPER_SPEEDUP})", "tree vs chain"]
        body = [[e["batch"], e["setup"], e["nodes"], e["expected"], e["tokens"], e["tpot_ms"], e["e2e_ms"],
                 e["speedup"], PAPER_SPEEDUP if e["nodes"] else "1x", e["vs_chain"]] for e in entries(rows)]
        return render_markdown(header, body, "rlrrrrrrlr")

    def plot(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Tokens per step and speed-up against verified drafts per step, chain and tree."""
        from servelab.bench.plots import _pyplot, save_figure

        plt = _pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        data = entries(rows)
        for batch in sorted({e["batch"] for e in data}):
            for kind, marker in (("chain", "o"), ("tree", "s")):
                mine = [e for e in data if e["batch"] == batch and (e["setup"].startswith(kind) or not e["nodes"])]
                xs = [e["nodes"] for e in mine]
                axes[0].plot(xs, [e["tokens"] for e in mine], marker=marker, label=f"{kind}, batch {batch}")
                axes[1].plot(xs, [e["speedup"] for e in mine], marker=marker, label=f"{kind}, batch {batch}")
        axes[1].axhspan(1.5, 2.8, color="grey", alpha=0.15, label="SpecInfer: 1.5-2.8x")
        axes[0].set_ylabel("tokens per target step")
        axes[1].set_ylabel("TPOT speed-up over incremental decoding")
        for axis in axes:
            axis.set_xlabel("verified draft tokens per step")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
        save_figure(fig, path)
