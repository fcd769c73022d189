"""Batch-1 sampled decode: the native sampler (``sample_rows``) against the torch path.

One request (16-token prompt, 128 tokens, a seed) through the offline ``LLM`` on one of
``servelab.bench.random_llama``'s models, for each sampling setting, alternating the two
paths (the torch path by hiding the native ops from ``sampler.sampled_tokens``); prints the
median decode tokens/s of ``--runs`` runs and the median time of a step's ``sample_tokens``:

    python benchmarks/sampling_speed.py --model 26m --overrides model.quantization=w8a8 model.quantization_lm_head=true

The random models' next-token distributions are nearly flat, which is top-p's worst case:
it keeps most of the vocabulary (a trained model's top-p set is a few tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from servelab import LLM, SamplingParams
from servelab.bench.random_llama import MODELS, make_checkpoint
from servelab.plugins.decoding import sampler, sampling

SETTINGS = {"temperature=0.7": dict(temperature=0.7), "top_p=0.9": dict(temperature=0.7, top_p=0.9),
            "top_k=50 top_p=0.95": dict(temperature=0.7, top_k=50, top_p=0.95)}
PROMPT = [2 + j for j in range(16)]


def run(llm: LLM, params: SamplingParams) -> tuple[float, float]:
    """Decode tokens/s and the median ``sample_tokens`` microseconds of one request."""
    seconds = []
    original = sampling.sample_tokens

    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = original(*args, **kwargs)
        seconds.append(time.perf_counter() - started)
        return result

    sampling.sample_tokens = timed
    try:
        times = llm.generate([PROMPT], params, use_tqdm=False)[0].metrics.token_times
    finally:
        sampling.sample_tokens = original
    return (len(times) - 1) / (times[-1] - times[0]), 1e6 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="26m", choices=sorted(MODELS))
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare"))
    args = parser.parse_args()
    folder = make_checkpoint(os.path.join(args.workdir, args.model), args.model)
    llm = LLM(folder, overrides=["device=cpu", "model.max_model_len=512", f"parallel.threads={args.threads}",
                                 *args.overrides])
    native = sampler.native_cpu_available
    print("| setting | path | decode tok/s | sample_tokens us |")
    print("|---|---|---:|---:|")
    try:
        llm.warm_up()
        for name, fields in SETTINGS.items():
            params = SamplingParams(seed=1, max_tokens=128, ignore_eos=True, **fields)
            results = {"native": [], "torch": []}
            for _ in range(args.runs):
                for path in results:
                    sampler.native_cpu_available = native if path == "native" else (lambda: False)
                    results[path].append(run(llm, params))
            for path, measured in results.items():
                print(f"| {name} | {path} | {statistics.median(r[0] for r in measured):.1f} | "
                      f"{statistics.median(r[1] for r in measured):.0f} |", flush=True)
    finally:
        sampler.native_cpu_available = native
        llm.shutdown()


if __name__ == "__main__":
    main()
