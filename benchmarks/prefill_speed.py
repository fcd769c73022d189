"""Prefill tokens/s in full scheduled steps: ``--prompts`` prompts of ``--prompt-tokens``
tokens each (default 4 x 500, one 2000-token step under the continuous scheduler's default
budget of max(2048, max_model_len) tokens), each generating one token, offline. A run's
rate is the prompt tokens over the wall time of ``generate``; the table gives the median of
``--repeats`` runs and every run, per model and mode.

    python benchmarks/prefill_speed.py --models 05b --modes float32 w8a8 int8 w4a8 int4 --repeats 3

Models are ``servelab.bench.random_llama``'s (random weights, written once under
``--folder``; at most 512 positions, so a long step is several prompts); ``--modes`` are
``decode_roofline.py``'s (a dtype, or a weight quantization with its LM head choice).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from decode_roofline import overrides_for  # the sibling script's modes

from servelab.bench.random_llama import MAX_POSITIONS, MODELS, make_checkpoint


def prefill_rates(folder: str, mode: str, prompts: int, prompt_tokens: int, threads: int,
                  repeats: int) -> list[float]:
    """Prompt tokens per second of ``repeats`` runs of ``prompts`` prompts in ``mode``."""
    from servelab import LLM, SamplingParams

    llm = LLM(folder, overrides=["device=cpu", f"model.max_model_len={MAX_POSITIONS}", f"parallel.threads={threads}",
                                 *overrides_for(mode)])
    llm.warm_up()
    batch = [[2 + (i * 7 + j * 13) % 1000 for j in range(prompt_tokens)] for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        rates.append(prompts * prompt_tokens / (time.perf_counter() - started))
    llm.shutdown()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["05b"], choices=sorted(MODELS))
    parser.add_argument("--modes", nargs="+", default=["float32"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "servelab-random-llama"))
    args = parser.parse_args()
    if not 0 < args.prompt_tokens < MAX_POSITIONS:
        parser.error(f"--prompt-tokens must be between 1 and {MAX_POSITIONS - 1} (the models' positions, "
                     f"less the generated token), got {args.prompt_tokens}")
    print(f"| model | mode | prefill tok/s ({args.prompts} x {args.prompt_tokens} tokens) | runs |")
    print("|---|---|---:|---|")
    for name in args.models:
        folder = make_checkpoint(os.path.join(args.folder, name), name)
        for mode in args.modes:
            rates = prefill_rates(folder, mode, args.prompts, args.prompt_tokens, args.threads, args.repeats)
            print(f"| {name} | {mode} | {statistics.median(rates):.0f} | {' '.join(f'{r:.0f}' for r in rates)} |",
                  flush=True)


if __name__ == "__main__":
    main()
