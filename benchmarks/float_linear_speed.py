"""float32 matmuls on the CPU: servelab's ``float_linear`` (weights in blocks of 16
channels) against oneDNN with a prepacked weight and against ``F.linear``.

``layers`` (the default) times one linear layer of the 26m benchmark model per shape and
row count. Each method cycles through enough copies of the weight (1 GiB, more than the
last-level cache) that every call reads it from memory, as a decode step's layers do, and the methods
take turns within each round, so their ratios share the machine's moment. Prints a markdown
table of median microseconds per call:

    python benchmarks/float_linear_speed.py layers --threads 2 --rows 1 6 16 64 512

``engine`` times generation on the 26m model in float32 (greedy, the best of five runs per
case) with the float32 layers on ``float_linear`` (``blocked``) or packed for oneDNN
(``onednn``, as servelab multiplied float32 before ``float_linear``); run the two in
alternation:

    for i in 1 2; do for m in blocked onednn; do python benchmarks/float_linear_speed.py engine $m; done; done
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F
from quantized_linear_speed import timed_cases  # the sibling script's timing loop

SHAPES = ((3072, 512), (512, 1536), (768, 512), (512, 512))
"""(out, in) features of the 26m model's layer: gate/up, down, q/k/v and the attention output."""
ENGINE_CASES = ((1, 140, 64), (6, 140, 64), (16, 140, 64), (8, 500, 1))
"""(requests, prompt tokens, output tokens) per engine case: decode at three batch sizes, one prefill."""


def layer_methods(out_features: int, in_features: int, copies: int) -> dict[str, list]:
    """Per method, ``copies`` callables x -> y over independent random weights."""
    from servelab.kernels.blocked_linear import float_linear, pack_blocks

    torch.manual_seed(0)
    result: dict[str, list] = {"float_linear": [], "onednn": [], "F.linear": []}
    for _ in range(copies):
        weight = torch.randn(out_features, in_features) * 0.02
        result["float_linear"].append(lambda x, p=pack_blocks(weight): float_linear(x, p, out_features))
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        result["onednn"].append(lambda x, p=onednn: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        result["F.linear"].append(lambda x, w=weight: F.linear(x, w))
    return result


def layers(args: argparse.Namespace) -> None:
    """Print the per-layer table."""
    print("| threads | layer N x K | rows | float_linear us | oneDNN us | F.linear us | vs oneDNN |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for threads, out_features, in_features, rows, ms in timed_cases(SHAPES, layer_methods, args.threads, args.rows,
                                                                     args.rounds):
        us = {name: value * 1e3 for name, value in ms.items()}
        print(f"| {threads} | {out_features}x{in_features} | {rows} | {us['float_linear']:.0f} | "
              f"{us['onednn']:.0f} | {us['F.linear']:.0f} | {us['onednn'] / us['float_linear']:.2f}x |", flush=True)


def engine(args: argparse.Namespace) -> None:
    """Print the best-of-five milliseconds per engine case with one way of multiplying."""
    import servelab.plugins.models.linear as packed_linear
    from servelab import LLM, SamplingParams
    from servelab.bench.random_llama import make_checkpoint

    if args.linear == "onednn":  # float32 weights then fall through to the oneDNN packing
        packed_linear.native_cpu_available = lambda: False
    torch.set_num_threads(args.threads[0])
    llm = LLM(make_checkpoint(args.model_dir, "26m"),
              overrides=["model.dtype=float32", "model.max_model_len=512", "scheduler.max_num_seqs=256"])
    llm.warm_up()
    rng = random.Random(0)
    result = {}
    for requests, prompt_tokens, output_tokens in ENGINE_CASES:
        params = [SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)] * requests
        prompts = [[rng.randrange(2, 2000) for _ in range(prompt_tokens)] for _ in range(requests)]
        llm.generate(prompts, params, use_tqdm=False)
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        result[f"{requests}x{prompt_tokens}+{output_tokens}"] = round(min(seconds) * 1e3, 1)
    print(args.linear, "ms:", result, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    layer_parser = sub.add_parser("layers", help="time one layer per shape and row count")
    layer_parser.add_argument("--rows", type=int, nargs="+", default=[1, 6, 16, 64, 512])
    layer_parser.add_argument("--rounds", type=int, default=9)
    engine_parser = sub.add_parser("engine", help="time generation on the 26m model")
    engine_parser.add_argument("linear", choices=["blocked", "onednn"])
    engine_parser.add_argument("--model-dir", default="/tmp/servelab-compare/26m")
    for sub_parser in (layer_parser, engine_parser):
        sub_parser.add_argument("--threads", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    if args.command == "engine":
        engine(args)
    else:
        if args.command is None:
            args = layer_parser.parse_args([])
        layers(args)


if __name__ == "__main__":
    main()
