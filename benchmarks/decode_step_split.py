"""Where a batch-1 decode step's time goes: the model with its LM head (the native stack's
one call, or the layer loop), building the step's inputs, choosing the token (0 where a
greedy step's token is chosen inside the model's native call), scheduling, and the rest.

One request (16-token prompt, 128 tokens, greedy) through the offline ``LLM`` on one of
``servelab.bench.random_llama``'s models; each part is timed around its call at every step
and the medians over the decode steps are printed, with the tokens/s of untimed runs:

    python benchmarks/decode_step_split.py --model 26m --modes float32 w8a8
    python benchmarks/decode_step_split.py --model 05b --modes w8a8 --runs 3

It also prints what a trivial call (``torch.Tensor.dim`` through a Python function) costs
right after the weights streamed through the caches, against the same call in a warm
loop: the host work between two forward passes runs with caches the forward pass has just
refilled, so it is bound by how many distinct calls it makes more than by their work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from servelab import LLM, SamplingParams
from servelab.bench.random_llama import MODELS, make_checkpoint
from servelab.plugins.executor import model as executor_module

MODES = {"float32": [], "bfloat16": ["model.dtype=bfloat16"],
         "int8": ["model.quantization=int8", "model.quantization_lm_head=true"],
         "w8a8": ["model.quantization=w8a8", "model.quantization_lm_head=true"],
         "int4": ["model.quantization=int4", "model.quantization_lm_head=true"],
         "w4a8": ["model.quantization=w4a8", "model.quantization_lm_head=true"]}
PROMPT = [2 + j for j in range(16)]


class StepTimer:
    """Times calls of wrapped methods by part, summed per engine step: ``steps`` holds one
    {part: seconds} per step (a part the step did not call is absent)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner: Any, name: str, part: str) -> None:
        """Time every call of ``owner.name`` as ``part``."""
        setattr(owner, name, self.timed(getattr(owner, name), part))

    def timed(self, fn: Callable, part: str) -> Callable:
        """``fn``, timed as ``part`` (a ``step`` call opens the next step's record)."""
        def call(*args, **kwargs):
            if part == "step":
                self.steps.append(defaultdict(float))
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            self.steps[-1][part] += time.perf_counter() - started
            return result
        return call

    def medians_us(self, parts: list[str], skip: int = 1) -> dict[str, float]:
        """Each part's median over the steps after the first ``skip`` (the prefill) in
        microseconds, a step that did not call it counting 0."""
        return {part: 1e6 * statistics.median(step.get(part, 0.0) for step in self.steps[skip:]) for part in parts}


def decode_tokens_per_s(llm: LLM) -> float:
    """One request's decode tokens/s (128 tokens after the 16-token prompt)."""
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    times = llm.generate([PROMPT], params, use_tqdm=False)[0].metrics.token_times
    return (len(times) - 1) / (times[-1] - times[0])


def split(llm: LLM) -> dict[str, float]:
    """The medians of one timed run's parts (microseconds); ``other`` is the step less its parts."""
    engine = llm.engine
    executor = engine.executor
    timer = StepTimer()
    wrapped = ((engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
               (executor.worker, "hidden_and_logits", "model"), (executor.worker, "greedy_tokens_or_logits", "model"),
               (executor.worker, "greedy_steps", "model"),
               (executor.strategy, "accept", "choose token"))
    for owner, name, part in wrapped:
        timer.wrap(owner, name, part)
    built = executor_module.build_step_inputs
    executor_module.build_step_inputs = timer.timed(built, "inputs")
    try:
        decode_tokens_per_s(llm)
    finally:
        executor_module.build_step_inputs = built
        for owner, name, _ in wrapped:
            delattr(owner, name)
    medians = timer.medians_us(["step", "schedule", "model", "choose token", "inputs"])
    medians["other"] = medians["step"] - sum(v for k, v in medians.items() if k != "step")
    return medians


def cold_call_us(llm: LLM) -> tuple[float, float]:
    """A trivial call's median time in a warm loop, and right after each of 128 decode steps."""
    x = torch.zeros(1)

    def trivial() -> int:
        return x.dim()

    warm = []
    for _ in range(1000):
        started = time.perf_counter()
        trivial()
        warm.append(time.perf_counter() - started)
    cold = []
    worker = llm.engine.executor.worker

    def then_probe(forward: Callable) -> Callable:
        def forward_then_probe(*args, **kwargs):
            result = forward(*args, **kwargs)
            started = time.perf_counter()
            trivial()
            cold.append(time.perf_counter() - started)
            return result
        return forward_then_probe

    forwards = ("hidden_and_logits", "greedy_tokens_or_logits", "greedy_steps")
    for name in forwards:
        setattr(worker, name, then_probe(getattr(worker, name)))
    try:
        decode_tokens_per_s(llm)
    finally:
        for name in forwards:
            delattr(worker, name)
    return 1e6 * statistics.median(warm), 1e6 * statistics.median(cold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="26m", choices=sorted(MODELS))
    parser.add_argument("--modes", nargs="+", default=["float32", "w8a8"], choices=sorted(MODES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5, help="untimed runs for tokens/s (median)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare"))
    args = parser.parse_args()

    folder = make_checkpoint(os.path.join(args.workdir, args.model), args.model)
    parts = ["model", "inputs", "choose token", "schedule", "other", "step"]
    print("| model | mode | tok/s | " + " | ".join(f"{p} us" for p in parts) + " | trivial call warm / after forward us |")
    print("|---|---|---:|" + "---:|" * (len(parts) + 1))
    for mode in args.modes:
        llm = LLM(folder, overrides=["device=cpu", "model.max_model_len=512", f"parallel.threads={args.threads}",
                                     *MODES[mode]])
        try:
            llm.warm_up()
            decode_tokens_per_s(llm)
            rate = statistics.median(decode_tokens_per_s(llm) for _ in range(args.runs))
            medians = split(llm)
            warm, cold = cold_call_us(llm)
        finally:
            llm.shutdown()
        print(f"| {args.model} | {mode} | {rate:.1f} | " + " | ".join(f"{medians[p]:.0f}" for p in parts)
              + f" | {warm:.2f} / {cold:.2f} |", flush=True)


if __name__ == "__main__":
    main()
