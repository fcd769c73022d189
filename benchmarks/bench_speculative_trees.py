"""Chain vs static tree vs dynamic tree on the trained tiny pair (target `tiny`, draft `tiny-draft`),
and the same shapes drafted by the EAGLE-style head of `tiny` (`checkpoints/tiny-eagle`).

Each configuration decodes the same prompts greedily at batch 1 (one request at a time)
or at a larger batch, after a warm-up; reported: output tokens/s, speed-up over
decoding=sampling, the accepted length (tokens a request gains per verification:
accepted drafts + 1, averaged over verifications), the nodes verified per
verification and the share of the time spent drafting (the strategy's ``propose``). Prompts are the openings of held-out standard-library files.

    OMP_NUM_THREADS=1 python benchmarks/bench_speculative_trees.py --prompts 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import time

from bench_speculative import DraftCounter

from servelab import LLM, SamplingParams
from servelab.bench.prompts import stdlib_file_openings
from servelab.bench.report import markdown_header, markdown_row

CONFIGS = {
    "sampling": ("sampling", []),
    "chain k=3": ("speculative", ["decoding.num_speculative_tokens=3"]),
    "chain k=5": ("speculative", ["decoding.num_speculative_tokens=5"]),
    "static tree, 8 nodes": ("speculative", ["decoding.tree=[[0],[1],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,0,0,0]]"]),
    "static tree, 14 nodes": ("speculative", ["decoding.tree=[[0],[1],[2],[0,0],[0,1],[0,2],[1,0],[1,1],[0,0,0],"
                                              "[0,0,1],[0,1,0],[0,0,0,0],[0,0,0,1],[0,0,0,0,0]]"]),
    "dynamic tree, 8 nodes": ("speculative", ["decoding.tree_nodes=8", "decoding.tree_depth=5", "decoding.tree_top_k=2"]),
    "dynamic tree, 14 nodes": ("speculative", ["decoding.tree_nodes=14", "decoding.tree_depth=6",
                                               "decoding.tree_top_k=3"]),
    "EAGLE chain k=3": ("eagle", ["decoding.num_speculative_tokens=3"]),
    "EAGLE static tree, 8 nodes": ("eagle", ["decoding.tree=[[0],[1],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,0,0,0]]"]),
    "EAGLE dynamic tree, 8 nodes": ("eagle", ["decoding.tree_nodes=8", "decoding.tree_depth=5", "decoding.tree_top_k=2"]),
    "EAGLE dynamic tree, 14 nodes": ("eagle", ["decoding.tree_nodes=14", "decoding.tree_depth=6",
                                               "decoding.tree_top_k=3"]),
}
HEADER = ["batch", "decoding", "tok/s", "speed-up", "accepted length", "nodes / verification", "drafting %"]


class Verifications(DraftCounter):
    """``DraftCounter``'s counts, and the seconds spent in the strategy's ``propose`` calls
    (the draft model's passes) while counting."""

    def __init__(self, strategy) -> None:
        super().__init__(strategy)
        self.propose_s = 0.0
        propose = strategy.propose

        def timed(batch):
            started = time.perf_counter()
            proposal = propose(batch)
            if self._on:
                self.propose_s += time.perf_counter() - started
            return proposal

        strategy.propose = timed


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """Seconds to decode ``prompts`` greedily, ``batch`` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        llm.generate(prompts[first:first + batch], params, use_tqdm=False)
    return time.perf_counter() - started


def main() -> None:
    """Print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--attention", default="sdpa")
    args = parser.parse_args()
    common = [f"attention={args.attention}", "model.dtype=float32"]
    print(markdown_header(HEADER, align="rlrrrrr"), flush=True)
    for batch in args.batch_sizes:
        base_tps = None
        for name, (decoding, overrides) in CONFIGS.items():
            llm = LLM("tiny", decoding=decoding, overrides=[*common, *overrides])
            prompts = stdlib_file_openings(args.prompts, llm.get_tokenizer(), args.prompt_tokens)
            counter = Verifications(llm.engine.strategy) if decoding != "sampling" else None
            run(llm, prompts[:batch], batch, 8)  # warm-up
            with counter.counting() if counter is not None else contextlib.nullcontext():
                seconds = run(llm, prompts, batch, args.max_tokens)
            tps = len(prompts) * args.max_tokens / seconds
            base_tps = base_tps or tps
            verified = counter.verifications if counter else 0
            length = f"{1 + counter.accepted / verified:.2f}" if verified else "1.00"
            nodes = f"{counter.proposed / verified:.1f}" if verified else "-"
            drafting = f"{100 * counter.propose_s / seconds:.0f}" if counter else "-"
            print(markdown_row([str(batch), name, f"{tps:.1f}", f"{tps / base_tps:.2f}x", length, nodes, drafting]),
                  flush=True)
            llm.shutdown()


if __name__ == "__main__":
    main()
