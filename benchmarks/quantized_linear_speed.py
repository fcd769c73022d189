"""Time per call of one linear layer with float32, int8 and int4 weight-only, int8 x int8 and
int4 x int8 (weights and dynamically quantized activations) matmuls, at the 0.5B model's layer
shapes.

Each method cycles through enough copies of the layer that its weights (``--footprint-mib``
of them for every method, default 1 GiB: more than the last-level cache of the machines
measured, 480 MiB on the largest) come from memory on every call, as a model's layers do in
a decode step; a single copy would stay in the cache and show its speed instead.
Methods run interleaved per shape and row count, so their ratios share the machine's
moment. As in an engine's steps, freed heap memory stays in the process and blocks of every
size come from the heap (``servelab.platform.retain_freed_heap_memory``,
``mmap_max_setter``), so a call's output, tens of MiB at prefill sizes, lands on pages
already mapped rather than on freshly faulted ones. Prints a markdown table of the median
ms per call (and ratios to float32):

    python benchmarks/quantized_linear_speed.py --threads 1 2 --rows 1 4 16 64 256
    python benchmarks/quantized_linear_speed.py --threads 2 --rows 1 --shapes 9728x896 151936x896 \
        --methods float32 int8-sliced w8a8 int4-sliced w4a8

``--shapes`` takes other (out x in) layers (the 0.5B model's fused gate/up is 9728x896, its
LM head 151936x896), ``--methods`` a subset of the methods (float32, whose time the ratios
divide, always runs).

Methods: ``float32`` servelab's ``Linear`` (float32 weights in ``float_linear``'s blocked
layout), ``int8`` servelab's weight-only kernel that widens each weight to float32 (``int8_linear``; CPUs without VNNI),
``int8-sliced`` its weight-only int8 kernel on int8 dot products (``int8_sliced_linear``: each
row split into three int8 slices; what int8 layers run on CPUs with AVX512-VNNI),
``w8a8`` servelab's int8 x int8 kernel (``w8a8_linear``: activations quantized per row),
``int4`` servelab's weight-only int4 kernel (``int4_linear``, groups of 128: the nibbles
widened to float32), ``int4-sliced`` its weight-only int4 kernel on int8 dot products
(``int4_sliced_linear``), ``w4a8`` its
int4 x int8 kernel (``w4a8_linear``: the same int4 weights, activations quantized per row), ``dynamic``
torch's quantized ``linear_dynamic`` (x86 engine: activations quantized per tensor, int8
dot products).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import torch

from servelab.plugins.models.linear import Linear
from servelab.kernels.int4_cpu import int4_linear, pack_int4_blocks
from servelab.kernels.quantized_cpu import int8_linear, int8_sliced_linear, pack_int8
from servelab.kernels.quantized_weights import quantize_int4, quantize_int8
from servelab.kernels.w4a8_cpu import int4_sliced_linear, pack_w4a8, w4a8_linear
from servelab.kernels.w8a8_cpu import pack_w8a8, w8a8_linear
from servelab.platform import mmap_max_setter, retain_freed_heap_memory

SHAPES = ((4864, 896), (896, 4864), (896, 896), (128, 896))
"""(out, in) features: the 0.5B model's MLP up and down, attention output and one KV head group."""
FOOTPRINT_MIB = 1024


def copies_of(tensors: tuple[torch.Tensor, ...], count: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` independent copies (fresh memory) of a packed weight's tensors."""
    return [tuple(t.clone() for t in tensors) for _ in range(count)]


METHODS = ("float32", "int8", "int8-sliced", "w8a8", "int4", "int4-sliced", "w4a8", "dynamic")
"""Every method, in the order they take turns and print."""


def methods(out_features: int, in_features: int, copies: int, names=METHODS) -> dict[str, list]:
    """Per method of ``names``, callables x -> y over independent copies of one random
    layer: ``copies`` of the float32 weight, and as many more of the narrower ones as fill
    the same bytes."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.02
    qweight, scales = quantize_int8(weight)
    int4 = quantize_int4(weight, 128)

    def float32() -> list:
        linears = []
        for _ in range(copies):
            linear = Linear(in_features, out_features, bias=False)
            with torch.no_grad():
                linear.weight.copy_(weight)
            linears.append(linear)
        return linears

    def dynamic() -> list:
        qtensor = torch._make_per_channel_quantized_tensor(qweight, scales.double(),
                                                           torch.zeros(out_features, dtype=torch.long), 0)
        return [lambda x, p=torch.ops.quantized.linear_prepack(qtensor.clone(), None):
                torch.ops.quantized.linear_dynamic(x, p, False) for _ in range(4 * copies)]

    def kernel(op, packed: tuple[torch.Tensor, ...], per_float32: int) -> Callable[[], list]:
        return lambda: [lambda x, p=p: op(x, *p, out_features) for p in copies_of(packed(), per_float32 * copies)]

    builders = {
        "float32": float32,
        "int8": kernel(int8_linear, lambda: pack_int8(qweight, scales), 4),
        "int8-sliced": kernel(int8_sliced_linear, lambda: pack_w8a8(qweight, scales), 4),
        "w8a8": kernel(w8a8_linear, lambda: pack_w8a8(qweight, scales), 4),
        "int4": kernel(int4_linear, lambda: pack_int4_blocks(*int4), 8),
        "int4-sliced": kernel(int4_sliced_linear, lambda: pack_w4a8(*int4), 8),
        "w4a8": kernel(w4a8_linear, lambda: pack_w4a8(*int4), 8),
        "dynamic": dynamic}
    return {name: builders[name]() for name in METHODS if name in names}


def shape(text: str) -> tuple[int, int]:
    """``--shapes``' "OUTxIN" as (out, in) features."""
    try:
        out_features, in_features = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layer shape is OUTxIN (two integers), got {text!r}") from None
    return out_features, in_features


def median_ms(calls: dict[str, list], x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Per method, the median time of one call over ``rounds`` passes through every copy
    (the methods take turns within each round)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, copies in calls.items():
            start = time.perf_counter()
            for call in copies:
                call(x)
            times[name].append((time.perf_counter() - start) / len(copies))
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def timed_cases(shapes, methods_of, threads_list: list[int], rows_list: list[int], rounds: int,
                footprint_mib: int = FOOTPRINT_MIB):
    """For every (out, in) shape, thread count and row count, yields (threads, out_features,
    in_features, rows, median ms per method) over ``methods_of(out, in, copies)``'s
    callables, ``copies`` float32 weights filling ``footprint_mib`` so that every call
    reads its weight from memory."""
    for out_features, in_features in shapes:
        copies = max(1, -(-(footprint_mib << 20) // (4 * out_features * in_features)))
        calls = methods_of(out_features, in_features, copies)
        for threads in threads_list:
            torch.set_num_threads(threads)
            for rows in rows_list:
                x = torch.randn(rows, in_features)
                with torch.inference_mode():
                    median_ms(calls, x, 1)  # warm up: oneDNN compiles a kernel per row count
                    yield threads, out_features, in_features, rows, median_ms(calls, x, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--footprint-mib", type=int, default=FOOTPRINT_MIB,
                        help="bytes of weight copies each method cycles through (MiB)")
    parser.add_argument("--shapes", type=shape, nargs="+", default=list(SHAPES), metavar="OUTxIN",
                        help="layers as out x in features (default: the 0.5B model's MLP up and down, "
                        "attention output and one KV head group)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="methods to time (float32 always runs: the ratios are to it)")
    args = parser.parse_args()
    chosen_methods = functools.partial(methods, names={"float32", *args.methods})
    torch.backends.quantized.engine = "x86"
    retain_freed_heap_memory()
    set_mmap_max = mmap_max_setter()
    if set_mmap_max is not None:
        set_mmap_max(0)
    for case, (threads, out_features, in_features, rows, ms) in enumerate(
            timed_cases(args.shapes, chosen_methods, args.threads, args.rows, args.rounds, args.footprint_mib)):
        if case == 0:
            names = list(ms)
            print("| threads | layer N x K | M | " + " | ".join(f"{name} ms" for name in names) + " | "
                  + " | ".join(f"{name} speed-up" for name in names[1:]) + " |")
            print("|---:|---|" + "---:|" * (2 * len(names)))
        times = " | ".join(f"{value:.3f}" for value in ms.values())
        ratios = " | ".join(f"{ms['float32'] / value:.2f}x" for value in list(ms.values())[1:])
        print(f"| {threads} | {out_features}x{in_features} | {rows} | {times} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
