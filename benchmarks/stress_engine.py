"""The engine's random stress, for longer than CI runs it: every scheduler under recompute
and swap preemption, random requests (``n > 1``, beam search, stop strings, logprobs,
seeds, penalties, shared prefixes) with random aborts on a 48-block paged cache with
prefix caching. Fails on any exception, unfinished request or held block:

    python benchmarks/stress_engine.py                         # 1,500 requests per run
    python benchmarks/stress_engine.py --requests 200 --schedulers chunked --modes swap
    python benchmarks/stress_engine.py --requests 300 \
        --overrides model.quantization=w4a8 model.quantization_group_size=32

Prints one line per run (requests finished and aborted, steps, preemptions, prefix-cache
hits, the mix) and the wall time. CI runs the same check at 60 requests with a fixed seed
(``servelab.testing.StressConformance``).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from tqdm.auto import tqdm

from servelab.core.engine.registry import get_registry
from servelab.testing.engine_kit import ENGINE_BASE
from servelab.testing.oracle import tiny_checkpoint
from servelab.testing.stress import STRESS_CACHE, run_stress


def main() -> None:
    """Run the stress for every scheduler x preemption mode asked for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--abort-rate", type=float, default=0.05, help="probability of an abort per step")
    parser.add_argument("--schedulers", nargs="*", default=sorted(get_registry().specs("scheduler")))
    parser.add_argument("--modes", nargs="*", default=["recompute", "swap"])
    parser.add_argument("--overrides", nargs="*", default=[], help="more config overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = tiny_checkpoint(f"{folder}/model", "llama")
        for scheduler in args.schedulers:
            for mode in args.modes:
                overrides = ["model=local", f"model.path={checkpoint}", *ENGINE_BASE, f"scheduler={scheduler}",
                             *STRESS_CACHE, f"scheduler.preemption={mode}", *args.overrides]
                started = time.perf_counter()
                with tqdm(total=args.requests, desc=f"{scheduler}/{mode}", unit="req", leave=False) as bar:
                    report = run_stress(overrides, args.requests, args.seed, args.abort_rate, progress=bar)
                print(f"{scheduler:>22} {mode:>9}: {report.num_finished} finished, {report.num_aborted} aborted, "
                      f"{report.num_steps} steps, {report.num_preemptions} preemptions, "
                      f"{report.prefix_hit_tokens} prefix-hit tokens; n>1 {report.num_parallel}, "
                      f"beam {report.num_beam}, stop strings {report.num_stop_strings}, "
                      f"logprobs {report.num_logprobs}; {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
