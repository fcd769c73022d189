"""Speculative decoding speed-up on the trained tiny pair (target `tiny`, draft `tiny-draft`).

For batch sizes 1 and 16 and k = 1..6: output tokens/s of decoding=speculative against
decoding=sampling (both greedy, same prompts, same engine settings), the share of drafts
accepted, the per-token acceptance rate alpha = accepted / (accepted + rejections) (each
verification examines drafts until its first rejection), the measured tokens per
verification step, and the i.i.d. prediction (1 - alpha^(k+1)) / (1 - alpha). Prompts
are the openings of held-out standard-library files (``servelab.bench.prompts``); each
run is ``servelab.bench.offline_run``'s warm-up and one timed ``generate``.

    OMP_NUM_THREADS=1 python benchmarks/bench_speculative.py --max-tokens 64 --out /tmp/speculative_table.md

``--out`` writes the table alone; docs/results/speculative.md holds it with the date and machine.
"""

from __future__ import annotations

import argparse
import contextlib

from servelab import LLM
from servelab.bench.offline_run import servelab_generate, servelab_token_ids, time_generate
from servelab.bench.prompts import stdlib_file_openings
from servelab.bench.report import markdown_header, markdown_row

HEADER = ["batch", "k", "sampling tok/s", "speculative tok/s", "speed-up", "drafts accepted", "alpha",
          "tokens/step", "predicted"]


class DraftCounter:
    """Counts, over the decoding strategy's ``accept`` calls while ``counting()`` is open,
    drafts proposed and accepted, verifications (a request verified with at least one
    draft) and rejections (a verification that kept fewer drafts than it had)."""

    def __init__(self, strategy) -> None:
        self.proposed = self.accepted = self.verifications = self.rejections = 0
        self._on = False
        accept = strategy.accept

        def counted(logits, batch, proposal):
            result = accept(logits, batch, proposal)
            if self._on and result.num_accepted_drafts is not None:
                for drafted, kept in zip(batch.num_draft_tokens, result.num_accepted_drafts):
                    self.proposed += drafted
                    self.accepted += kept
                    self.verifications += drafted > 0
                    self.rejections += kept < drafted
            return result

        strategy.accept = counted

    @contextlib.contextmanager
    def counting(self):
        """Count the calls made inside this context (the timed run)."""
        self._on = True
        try:
            yield
        finally:
            self._on = False


def tokens_per_second(llm: LLM, prompts: list[list[int]], max_tokens: int, timed=contextlib.nullcontext) -> float:
    """Output tokens/s of one timed greedy ``generate`` over ``prompts`` (after a warm-up)."""
    run = time_generate(servelab_generate(llm), servelab_token_ids,
                        {"prompts": prompts, "max_tokens": [max_tokens] * len(prompts)}, "servelab", timed)
    return run["output_tokens"] / run["seconds"]


def main() -> None:
    """Print (and optionally write) the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    common = ["attention=sdpa", "model.dtype=float32"]
    baseline = LLM("tiny", decoding="sampling", overrides=common)
    prompts_all = stdlib_file_openings(max(args.batch_sizes), baseline.get_tokenizer(), args.prompt_tokens)
    lines = [markdown_header(HEADER, align="r" * len(HEADER))]
    print(lines[0], flush=True)
    for batch in args.batch_sizes:
        prompts = prompts_all[:batch]
        base_tps = tokens_per_second(baseline, prompts, args.max_tokens)
        for k in args.ks:
            spec = LLM("tiny", decoding="speculative", overrides=[*common, f"decoding.num_speculative_tokens={k}"])
            drafts = DraftCounter(spec.engine.strategy)
            spec_tps = tokens_per_second(spec, prompts, args.max_tokens, drafts.counting)
            share = drafts.accepted / drafts.proposed if drafts.proposed else 0.0
            judged = drafts.accepted + drafts.rejections
            alpha = drafts.accepted / judged if judged else 0.0
            per_step = (drafts.accepted + drafts.verifications) / drafts.verifications if drafts.verifications else 1.0
            predicted = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
            lines.append(markdown_row([str(batch), str(k), f"{base_tps:.1f}", f"{spec_tps:.1f}",
                                       f"{spec_tps / base_tps:.2f}x", f"{share:.3f}", f"{alpha:.3f}",
                                       f"{per_step:.2f}", f"{predicted:.2f}"]))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
