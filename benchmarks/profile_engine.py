"""Where an engine step's time goes: model forward vs everything else (scheduling, cache
bookkeeping, input preparation, sampling, detokenization), plus a cProfile summary.

Runs the offline workload of compare_vllm.py (256 requests, prompts 16-256 tokens, 128
output tokens) on one of its models and prints the split and the top functions:

    python benchmarks/profile_engine.py --model 26m --dtype float32
    python benchmarks/profile_engine.py --model 26m --dtype bfloat16 --profiler torch

``--profiler torch`` lists operators by self CPU time (torch.profiler) instead of Python
functions (cProfile); ``--profiler none`` gives the split without a profiler's overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_vllm import make_checkpoint, make_workload  # noqa: E402


def main() -> None:
    """Profile one offline run and print the forward / overhead split."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="26m", choices=["26m", "3m"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--overrides", nargs="*", default=["attention=cpu"])
    parser.add_argument("--workdir", default="/tmp/servelab-compare")
    parser.add_argument("--profiler", choices=["cprofile", "torch", "none"], default="cprofile")
    args = parser.parse_args()
    from servelab import LLM, SamplingParams

    os.makedirs(args.workdir, exist_ok=True)
    folder = make_checkpoint(os.path.join(args.workdir, args.model), args.model)
    with open(make_workload(os.path.join(args.workdir, "workload.json"), 256, 128)) as f:
        workload = json.load(f)
    llm = LLM(folder, overrides=[f"model.dtype={args.dtype}", "model.max_model_len=512", "scheduler.max_num_seqs=256",
                                 *args.overrides])
    runner = llm.engine.runner
    forward_time = [0.0]
    model_forward, compute_logits = runner.model.forward, runner.model.compute_logits

    def timed(fn):
        def wrapper(*a, **k):
            started = time.perf_counter()
            result = fn(*a, **k)
            forward_time[0] += time.perf_counter() - started
            return result
        return wrapper

    runner.model.forward, runner.model.compute_logits = timed(model_forward), timed(compute_logits)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.warm_up()
    llm.generate(workload["prompts"][:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    forward_time[0] = 0.0
    profile = {"torch": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
               "cprofile": cProfile.Profile, "none": contextlib.nullcontext}[args.profiler]()
    started = time.perf_counter()
    with profile:
        outputs = llm.generate(workload["prompts"], params, use_tqdm=False)
    total = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    overhead = total - forward_time[0]
    print(f"{args.model} {args.dtype}: {tokens} tokens in {total:.1f}s ({tokens / total:.1f} tok/s), "
          f"{llm.engine.num_steps} steps")
    print(f"model forward + logits: {forward_time[0]:.1f}s ({100 * forward_time[0] / total:.1f}%); "
          f"engine overhead: {overhead:.1f}s ({100 * overhead / total:.1f}%)")
    if args.profiler == "torch":
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48))
    elif args.profiler == "cprofile":
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())


if __name__ == "__main__":
    main()
