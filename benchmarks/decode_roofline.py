"""Decode against the memory-bandwidth roofline: how close each decode step comes to the
bytes it must read divided by this machine's read bandwidth.

A decode step reads every weight the forward pass multiplies by once, at its stored
width (``servelab.bench.random_llama.matmul_parameters``: every linear layer and the LM
head, of a mixture of experts the router and the experts the step's tokens were routed
to, counted per step; int8 as one byte, int4 as half of one, bfloat16 two, float32 four;
scales left out), the embedding rows of its tokens, and the KV cache each request attends over, at
the cache's dtype. The read bandwidth is measured in the same run with the engine's
threads: the best of several passes of a 1 GiB float32 matrix-vector product and sum,
the reads a decode step is made of. For each batch size, ``batch`` requests with
16-token prompts decode 128 tokens together; the step time is the median of the steps
that only decode. The fraction is (bytes per step / step time) / bandwidth.

A model whose step reads less than the last-level cache holds (the 26M model's 105 MB in
float32 on a VM with a 480 MiB L3) is read from that cache, step after step, faster than
from memory, so its fraction of the memory bandwidth can pass 100%. Each row therefore
also gives the read rate at the step's own size, measured the same way over a matrix of
the step's bytes right after the run (best of at least five passes, more for smaller
sizes: as many as read 5 GiB), and the step's fraction of that: the ceiling where the
weights stay in cache, and about the memory bandwidth where they do not.

    python benchmarks/decode_roofline.py --models 26m 05b --modes float32 bfloat16 int8 w8a8 --batches 1 4 16

``--overrides`` adds config overrides to every run; with ``decoding.multi_step=N`` a
scheduled step runs up to N model steps (greedy: in one native call), and the time of a
decode step is the scheduled step's time over the model steps it ran:

    python benchmarks/decode_roofline.py --models 05b --modes int8 --batches 1 --overrides decoding.multi_step=8

``--clock cpu`` times the bandwidth passes and the steps with the process's CPU time
instead of the wall clock: on a machine shared with other work, the time the process
was not running then does not count (memory contention still does); with ``--threads 1``
it is the engine's own time.

Models are ``servelab.bench.random_llama``'s (random weights, written once under
``--folder``); ``--modes`` are a dtype (``float32``, ``bfloat16``) or a weight
quantization (``int8``, ``w8a8`` with the LM head quantized too; ``int4`` with a float32
head, ``int4-head`` with an int8 one, ``int4-head4`` with an int4 one; ``w4a8`` with an int8
head, ``w4a8-head4`` with an int4 one). A weight-only mode with ``-widened`` after it
(``int8-widened``, ``int4-head-widened``) runs through the kernels of CPUs without int8 dot
products (``int8_linear``, ``int4_linear``: each weight widened to float32) where the mode
itself takes ``int8_sliced_linear`` or ``int4_sliced_linear``, to compare them on one
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any, Callable
from unittest import mock

import torch

from servelab.bench.random_llama import MODELS, VOCAB, make_checkpoint, matmul_parameters

PROMPT_TOKENS = 16
DECODE_TOKENS = 128
QUANTIZATIONS = {"int8": ("int8", "true"), "w8a8": ("w8a8", "true"), "int4": ("int4", "false"),
                 "int4-head": ("int4", "true"), "int4-head4": ("int4", "int4"), "w4a8": ("w4a8", "true"),
                 "w4a8-head4": ("w4a8", "int4")}
"""Each quantized mode's ``model.quantization`` and ``model.quantization_lm_head``."""
WIDENED = "-widened"
"""A weight-only mode's suffix for the widening kernels."""
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""``--clock``: the wall clock, or the CPU time of this process (all its threads)."""


def read_bandwidth(threads: int, clock: Callable[[], float] = time.perf_counter, gib: float = 1.0,
                   repeats: int = 5) -> float:
    """Bytes per second of the best of ``repeats`` passes of a matrix-vector product and
    of a sum over a ``gib`` GiB float32 matrix, timed by ``clock``."""
    torch.set_num_threads(threads)
    matrix = torch.ones(int(gib * 2**30) // 4 // 4096, 4096)
    vector = torch.ones(4096)
    best = 0.0
    for read in (lambda: torch.mv(matrix, vector), matrix.sum):
        for _ in range(repeats):
            started = clock()
            read()
            best = max(best, matrix.numel() * 4 / (clock() - started))
    return best


def overrides_for(mode: str) -> list[str]:
    """The engine overrides of a mode: a dtype, or a weight quantization with its LM head
    (``QUANTIZATIONS``)."""
    mode = mode.removesuffix(WIDENED)
    if mode in QUANTIZATIONS:
        quantization, head = QUANTIZATIONS[mode]
        return ["model.dtype=float32", f"model.quantization={quantization}", f"model.quantization_lm_head={head}"]
    return [f"model.dtype={mode}"]


INT4_WIDTH = 0.5 + 2 * 4 / 128
"""An int4 weight's bytes as the kernels read them: the nibble and its share of its group's
float32 scale and offset (groups of 128, the default)."""
HEAD_WIDTH = {"false": 4.0, "true": 1.0, "int4": INT4_WIDTH}
"""Bytes per LM head weight by ``model.quantization_lm_head`` (float32, int8, int4)."""
WIDTH = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "w8a8": 1.0, "int4": INT4_WIDTH, "w4a8": INT4_WIDTH}
"""Bytes per stored weight of each dtype and ``model.quantization`` (int8's one scale per
row is left out: 1/K of a byte)."""


def weight_bytes(name: str, mode: str, batch: int, experts: float | None = None) -> float:
    """Bytes one decode step reads of the weights: the matmul weights at their stored
    width (int4 with its group scales and offsets; the LM head as the mode quantizes it; of
    a mixture, ``experts`` experts per sparse layer) and the ``batch`` embedding rows
    (float32 in the quantized modes)."""
    mode = mode.removesuffix(WIDENED)
    shape = MODELS[name]
    hidden = shape["hidden_size"]
    if mode not in QUANTIZATIONS:
        return matmul_parameters(name, experts) * WIDTH[mode] + batch * hidden * WIDTH[mode]
    quantization, head_setting = QUANTIZATIONS[mode]
    head = hidden * shape.get("vocab_size", VOCAB)
    return ((matmul_parameters(name, experts) - head) * WIDTH[quantization] + head * HEAD_WIDTH[head_setting]
            + batch * hidden * 4.0)


def decode_step_seconds(llm: Any, batch: int, clock: Callable[[], float]) -> tuple[float, float, float | None]:
    """Median seconds (by ``clock``) of the decode-only steps of ``batch`` requests decoding
    ``DECODE_TOKENS`` tokens together, their mean context length, and for a mixture of
    experts the mean number of experts a sparse layer multiplied in those steps (read from
    the layers' routed-pair counters between steps, outside the timing; None when dense)."""
    from servelab import SamplingParams
    from servelab.plugins.models.moe import routed_pairs

    engine = llm.engine
    model = engine.executor.worker.model
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request([2 + (i * 7 + j) % 1000 for j in range(PROMPT_TOKENS)], params)
    times: list[float] = []
    touched: list[float] = []
    counts = routed_pairs(model)
    while engine.has_unfinished_requests():
        started = clock()
        engine.step()
        times.append(clock() - started)
        after = routed_pairs(model)
        if after:
            touched.append(statistics.mean(sum(b > a for a, b in zip(counts[layer], after[layer])) for layer in after))
        counts = after
    experts = statistics.mean(touched[1:]) if touched else None
    # The first step prefills (and chooses the first token); each later one runs up to
    # `decoding.multi_step` model steps, as many as the tokens left allow.
    steps = engine.strategy.decode_steps
    runs = [min(steps, DECODE_TOKENS - 1 - steps * i) for i in range(len(times) - 1)]
    if sum(runs) != DECODE_TOKENS - 1 or min(runs) < 1:
        raise RuntimeError(f"{len(times) - 1} decode steps of up to {steps} model steps each do not make the "
                           f"{DECODE_TOKENS - 1} tokens after the first: cannot tell each step's model steps")
    per_model_step = [seconds / run for seconds, run in zip(times[1:], runs)]
    return statistics.median(per_model_step), PROMPT_TOKENS + DECODE_TOKENS / 2, experts


def measure(name: str, folder: str, mode: str, batches: list[int], threads: int, bandwidth: float,
            clock: Callable[[], float], overrides: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per batch size for model ``name`` (written in ``folder``) in ``mode``, with
    ``overrides`` added to the engine's config."""
    from servelab import LLM
    from servelab.plugins.models import quantized_linear

    widened = mock.patch.object(quantized_linear, "slices_on_dot_products", lambda: False)
    with widened if mode.endswith(WIDENED) else contextlib.nullcontext():
        llm = LLM(folder, overrides=["device=cpu", "model.max_model_len=512", f"parallel.threads={threads}",
                                     *overrides_for(mode), *overrides])
        llm.warm_up()
        rows = []
        for batch in batches:
            seconds, context, experts = decode_step_seconds(llm, batch, clock)
            read = weight_bytes(name, mode, batch, experts) + batch * context * llm.engine.cache.spec.bytes_per_token
            gib = read / 2**30
            at_size = read_bandwidth(threads, clock, gib=gib, repeats=max(5, round(5 / gib)))
            rows.append({"mode": mode, "batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds,
                         "mb_per_step": read / 1e6, "gb_per_s": read / seconds / 1e9,
                         "fraction": read / seconds / bandwidth, "size_gb_per_s": at_size / 1e9,
                         "size_fraction": read / seconds / at_size})
        llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["26m"])
    parser.add_argument("--modes", nargs="+", default=["float32"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "servelab-random-llama"))
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--overrides", nargs="*", default=[],
                        help="more servelab config overrides for every run (decoding.multi_step=8, say)")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    bandwidth = read_bandwidth(args.threads, clock)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads, {args.clock} clock, best of 5 "
          f"matrix-vector products and sums over 1 GiB)")
    print("| model | mode | batch | step ms | tok/s | MB read/step | GB/s | of bandwidth | read GB/s at this size "
          "| of that |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        folder = make_checkpoint(os.path.join(args.folder, name), name)
        for mode in args.modes:
            for row in measure(name, folder, mode, args.batches, args.threads, bandwidth, clock, args.overrides):
                print(f"| {name} | {' '.join([row['mode'], *args.overrides])} | {row['batch']} | {row['step_ms']:.2f} | {row['tokens_per_s']:.0f} "
                      f"| {row['mb_per_step']:.1f} | {row['gb_per_s']:.1f} | {row['fraction']:.0%} "
                      f"| {row['size_gb_per_s']:.1f} | {row['size_fraction']:.0%} |", flush=True)
    print(f"re-measured read bandwidth: {read_bandwidth(args.threads, clock) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
