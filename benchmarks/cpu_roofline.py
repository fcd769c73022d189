"""The compute roofline of this CPU for a model: measured matmul FLOP/s x FLOPs per token.

FLOPs per generated token = 2 x (parameters that take part in a matmul: every linear
layer and the LM head; the embedding lookup is not a matmul) of one of
``servelab.bench.random_llama``'s models. The matmul rate is the best
of several large GEMMs shaped like a decode batch (tokens x hidden @ hidden x out), in
the dtype servelab's linear layers compute in: bfloat16 on a CPU without bfloat16 matmul
instructions is measured in float32, as servelab multiplies it there.

    python benchmarks/cpu_roofline.py --model 26m --dtype float32 --threads 2

With ``--watch SECONDS`` it samples the matmul rate once a second instead, best of 3 calls
per sample, to show how far the machine's compute rate drifts (on a shared VM it can move
by 3x from one second to the next, which is why the comparisons alternate engines):

    python benchmarks/cpu_roofline.py --dtype bfloat16 --threads 1 --watch 60
"""

from __future__ import annotations

import argparse
import time

import torch

from servelab.bench.random_llama import MODELS, matmul_parameters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype servelab's linear layers multiply ``dtype`` weights in on this CPU."""
    from servelab.plugins.models.linear import bfloat16_matmul_supported

    return torch.float32 if dtype == torch.bfloat16 and not bfloat16_matmul_supported() else dtype


def matmul_flops(dtype: torch.dtype, tokens: int = 256, size: int = 1536, repeats: int = 20) -> float:
    """Best FLOP/s of [tokens, size] @ [size, size] in ``dtype``."""
    a = torch.randn(tokens, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * tokens * size * size / (time.perf_counter() - started))
    return best


def watch(dtype: torch.dtype, seconds: float) -> None:
    """Print the matmul rate once a second for ``seconds``, then its range."""
    started, rates = time.perf_counter(), []
    while time.perf_counter() - started < seconds:
        rates.append(matmul_flops(dtype, repeats=3))
        print(f"{time.perf_counter() - started:6.1f} s  matmul {rates[-1] / 1e9:7.1f} GFLOP/s", flush=True)
        time.sleep(1.0)
    print(f"{len(rates)} samples: {min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f} GFLOP/s "
          f"(max/min {max(rates) / min(rates):.2f}x)")


def main() -> None:
    """Print the matmul rate, FLOPs per token and the roofline in tokens/s."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="26m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="sample the matmul rate for this long")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = compute_dtype(DTYPES[args.dtype])
    if args.watch:
        watch(dtype, args.watch)
        return
    rate = matmul_flops(dtype)
    per_token = 2 * matmul_parameters(args.model)
    computed_in = "" if dtype == DTYPES[args.dtype] else f" (computed in {str(dtype).removeprefix('torch.')})"
    print(f"{args.model} {args.dtype}{computed_in} threads={args.threads}: matmul {rate / 1e9:.1f} GFLOP/s, "
          f"{per_token / 1e6:.1f} MFLOP/token, roofline {rate / per_token:.0f} tok/s")


if __name__ == "__main__":
    main()
