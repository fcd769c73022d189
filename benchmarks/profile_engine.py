"""Where an engine step's time goes: model forward vs everything else (scheduling, cache
bookkeeping, input preparation, sampling, detokenization), plus a cProfile summary.

Runs compare_vllm.py's offline measurement (``servelab.bench.offline_run`` over
``servelab-bench``'s ``offline`` preset: 256 requests, prompts 16-256 tokens, 128 output
tokens) on one of its models and prints the split and the top functions:

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
import os
import pstats
import tempfile
import time

import torch

from servelab.bench.offline_run import (read_workload_file, servelab_generate, servelab_llm, servelab_token_ids,
                                        time_generate, write_comparison_workload)
from servelab.bench.random_llama import MODELS, make_checkpoint

PROFILERS = {"torch": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
             "cprofile": cProfile.Profile, "none": contextlib.nullcontext}


class ForwardTimer:
    """Wraps a model's ``forward`` and ``compute_logits`` and adds up the seconds spent in them."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        model.forward, model.compute_logits = self._timed(model.forward), self._timed(model.compute_logits)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - started
            return result
        return wrapper


def main() -> None:
    """Profile one offline run and print the forward / overhead split."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="26m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--overrides", nargs="*", default=["attention=cpu"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare"))
    parser.add_argument("--profiler", choices=sorted(PROFILERS), default="cprofile")
    args = parser.parse_args()

    os.makedirs(args.workdir, exist_ok=True)
    folder = make_checkpoint(os.path.join(args.workdir, args.model), args.model)
    workload = read_workload_file(write_comparison_workload(os.path.join(args.workdir, "profile_workload.json"),
                                                            args.requests, args.output_tokens))
    llm = servelab_llm(folder, workload, args.dtype, args.overrides)
    forward = ForwardTimer(llm.engine.executor.model)
    profile = PROFILERS[args.profiler]()
    steps = {}

    @contextlib.contextmanager
    def timed():
        """Around the timed run only: the profiler, the forward timer and the step count."""
        forward.seconds, first = 0.0, llm.engine.num_steps
        with profile:
            yield
        steps["timed"] = llm.engine.num_steps - first

    run = time_generate(servelab_generate(llm), servelab_token_ids, workload, "servelab", timed)
    total, tokens = run["seconds"], run["output_tokens"]
    overhead = total - forward.seconds
    print(f"{args.model} {args.dtype}: {tokens} tokens in {total:.1f}s ({tokens / total:.1f} tok/s), "
          f"{steps['timed']} steps")
    print(f"model forward + logits: {forward.seconds:.1f}s ({100 * forward.seconds / total:.1f}%); "
          f"engine overhead: {overhead:.1f}s ({100 * overhead / total:.1f}%)")
    if args.profiler == "torch":
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48))
    elif args.profiler == "cprofile":
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())


if __name__ == "__main__":
    main()
