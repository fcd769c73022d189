"""Speculative decoding speed-up on the trained tiny pair (target `tiny`, draft `tiny-draft`).

For batch sizes 1 and 16 and k = 1..6: output tokens/s of decoding=speculative against
decoding=sampling (both greedy, same prompts, same engine settings), the share of drafts
accepted, the per-token acceptance rate alpha = accepted / (accepted + rejections) (each
verification examines drafts until its first rejection), the measured tokens per
verification step, and the i.i.d. prediction (1 - alpha^(k+1)) / (1 - alpha). Prompts
are the openings of held-out standard-library files (the models' validation split).

    python benchmarks/bench_speculative.py --max-tokens 64 --out docs/results/speculative.md
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time

from servelab import LLM, SamplingParams


def heldout_prompts(count: int, tokenizer, prompt_tokens: int) -> list[list[int]]:
    """Token ids of the first ``prompt_tokens`` tokens of validation files (index % 20 == 0)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                   if f.endswith(".py") and "site-packages" not in d and "/test" not in d and "idlelib" not in d)
    prompts = []
    for path in files[::20]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            ids = tokenizer.encode(f.read(), add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens for one greedy generate call."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outputs)


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
    prompts_all = heldout_prompts(max(args.batch_sizes), baseline.get_tokenizer(), args.prompt_tokens)
    lines = ["| batch | k | sampling tok/s | speculative tok/s | speed-up | drafts accepted | alpha | tokens/step |"
             " predicted |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch in args.batch_sizes:
        prompts = prompts_all[:batch]
        run(baseline, prompts[:1], 4)
        base_time, base_tokens = run(baseline, prompts, args.max_tokens)
        for k in args.ks:
            spec = LLM("tiny", decoding="speculative", overrides=[*common, f"decoding.num_speculative_tokens={k}"])
            run(spec, prompts[:1], 4)
            runner = spec.engine.runner
            before = (runner.spec_proposed, runner.spec_accepted, runner.spec_verifications, runner.spec_rejections)
            spec_time, spec_tokens = run(spec, prompts, args.max_tokens)
            proposed = runner.spec_proposed - before[0]
            accepted = runner.spec_accepted - before[1]
            verifications = runner.spec_verifications - before[2]
            rejections = runner.spec_rejections - before[3]
            share = accepted / proposed if proposed else 0.0
            alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
            per_step = (accepted + verifications) / verifications if verifications else 1.0
            predicted = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
            lines.append(f"| {batch} | {k} | {base_tokens / base_time:.1f} | {spec_tokens / spec_time:.1f} | "
                         f"{base_time / spec_time:.2f}x | {share:.3f} | {alpha:.3f} | {per_step:.2f} | {predicted:.2f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
