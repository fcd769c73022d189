"""The cost models against GPU measurements: calibration and error tables.

``calibrate`` fits the roofline's constants to the shipped A100/H100 tables (Vidur's
measurements, ``plugins/cost_model/tables/``): per GPU the ``compute_efficiency`` and
``memory_efficiency`` of ``conf/hardware/*.yaml``, with one ``kernel_overhead_s`` for both
(the roofline's config default), minimizing the mean |log(predicted / measured)| of the
per-layer times plus that of the four matmuls, over every token count, both models and
TP 1-8; and the ``interconnect_latency_s`` and ``interconnect_efficiency`` of each DGX
all-reduce table's intra-node series. ``report`` prints markdown tables: the roofline's
per-operator and per-layer error against the tables, all-reduce error, and end-to-end
batch-1 step times of both cost models against published latencies::

    python benchmarks/validate_cost_models.py calibrate
    python benchmarks/validate_cost_models.py report > docs/results/simulation/gpu_validation.md

``cpu FOLDER`` tabulates real ``servelab-bench`` runs on this CPU against the same runs
simulated with ``cost_model=profiled`` (docs/results/simulation.md has the commands).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import replace

import numpy as np
from omegaconf import OmegaConf

from servelab.core.checkpoint import load_checkpoint
from servelab.core.entrypoints.compose import compose_config
from servelab.core.config import ParallelConfig
from servelab.core.cost_model import BatchShape, CostModelContext
from servelab.core.engine.registry import get_registry
from servelab.plugins.cost_model.collectives import all_reduce_time
from servelab.plugins.cost_model.operators import LAYER_OPERATORS, Widths, layer_operators
from servelab.plugins.cost_model.profiled import ProfiledCostModel, ProfiledCostModelConfig
from servelab.plugins.cost_model.roofline import RooflineCostModel, RooflineCostModelConfig
from servelab.plugins.cost_model.table import load_table, shipped_tables

GPUS = {"a100-80gb": "a100", "h100-80gb": "h100"}
MODELS = ("llama-2-7b", "llama-2-70b")
MATMULS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
NETWORKS = {"a100-80gb": "vidur-a100-dgx-all-reduce.json", "h100-80gb": "vidur-h100-dgx-all-reduce.json"}

# Published batch-1 latencies on A100 80GB SXM (FP16/BF16): (what, model, TP, batch, cited ms, source).
PUBLISHED = [
    ("TTFT, 128-token prompt", "llama-2-7b", 1, BatchShape((128,), (128,), 1), 16.0, "trtllm"),
    ("TTFT, 2048-token prompt", "llama-2-7b", 1, BatchShape((2048,), (2048,), 1), 133.0, "trtllm"),
    ("TTFT, 128-token prompt", "llama-2-70b", 4, BatchShape((128,), (128,), 1), 47.0, "trtllm"),
    ("TTFT, 2048-token prompt", "llama-2-70b", 4, BatchShape((2048,), (2048,), 1), 377.0, "trtllm"),
    ("TPOT, 5-token prompt, 200 tokens", "llama-2-7b", 1, BatchShape((1,), (105,), 1), 1000 / 104.9, "gptfast"),
    ("TPOT, 5-token prompt, 200 tokens", "llama-2-70b", 4, BatchShape((1,), (105,), 1), 1000 / 38.01, "gptfast"),
]
SOURCES = {
    "trtllm": "TensorRT-LLM performance.md, Low Latency, A100 FP16, v0.5 (github.com/NVIDIA/TensorRT-LLM/blob/"
              "138f96d45f90b9667426f7c47297d8c06bafac73/docs/source/performance.md)",
    "gptfast": "gpt-fast README, batch 1, bf16, A100-80GB power-limited to 330 W: Llama-2-7B 104.9 tok/s, "
               "Llama-2-70B TP4 38.01 tok/s (github.com/pytorch-labs/gpt-fast/blob/"
               "0f925b5d4ce457b89a7ca6c9ce50f42bf2576945/README.md)",
}


def model_shape(preset: str):
    """The ``ModelShape`` of a ``conf/model`` preset."""
    cfg = compose_config([f"model={preset}", "executor=simulated"])
    checkpoint = load_checkpoint(cfg.model)
    return get_registry().get("model", checkpoint.architecture).cls.shape_of(checkpoint.hf_config)


def hardware(name: str):
    """The ``HardwareConfig`` of a ``conf/hardware`` preset."""
    return OmegaConf.to_object(compose_config([f"hardware={name}"]).hardware)


def context(preset: str, hw, tp: int) -> CostModelContext:
    """A float16 cost model context for ``preset`` on ``hw`` over ``tp`` ranks."""
    return CostModelContext(model_shape(preset), hw, ParallelConfig(tp, 1), 2.0, 2.0, 2.0)


def operator_points(gpu: str, preset: str):
    """(tp, tokens, operator, flops, bytes, measured seconds) of every table point."""
    table = load_table(next(p for p in shipped_tables() if p.name == f"vidur-{GPUS[gpu]}-{preset}.json"))
    shape = model_shape(preset)
    for tp in table.values("mlp_up_proj", "tensor_parallel_size"):
        widths = Widths.of(shape, tp, 2.0, 2.0, 2.0)
        for tokens in table.find("mlp_up_proj", tensor_parallel_size=tp).grid[0]:
            for op in layer_operators(int(tokens), widths):
                measured = table.find(op.name, tensor_parallel_size=tp).at(tokens)
                yield tp, int(tokens), op.name, op.flops, op.bytes, measured


def calibrate() -> None:
    """Print the fitted efficiencies and overheads (see the module docstring)."""
    data = {}
    for gpu in GPUS:
        rows = [(f"{preset}/{tp}/{n}", name, f, b, m) for preset in MODELS
                for tp, n, name, f, b, m in operator_points(gpu, preset)]
        layer_ids = {key: i for i, key in enumerate(dict.fromkeys(r[0] for r in rows))}
        data[gpu] = (np.array([layer_ids[r[0]] for r in rows]), np.array([r[1] in MATMULS for r in rows]),
                     np.array([r[2] for r in rows]), np.array([r[3] for r in rows]), np.array([r[4] for r in rows]))

    def best(gpu, overhead, efficiencies):
        layer, matmul, flops, nbytes, measured = data[gpu]
        hw = hardware(gpu)
        measured_layer = np.bincount(layer, measured)
        results = []
        for ce, me in efficiencies:
            predicted = np.maximum(flops / (hw.peak_flops * ce), nbytes / (hw.memory_bandwidth * me)) + overhead
            score = (np.abs(np.log(np.bincount(layer, predicted) / measured_layer)).mean()
                     + np.abs(np.log(predicted[matmul] / measured[matmul])).mean())
            results.append((score, ce, me))
        return min(results)

    coarse = list(itertools.product(np.arange(0.30, 1.001, 0.05), repeat=2))
    fits = {}
    for overhead in np.arange(0.0, 10.01, 0.5) * 1e-6:
        per_gpu = {}
        for gpu in GPUS:
            _, ce, me = best(gpu, overhead, coarse)
            fine = list(itertools.product(np.arange(ce - 0.05, ce + 0.051, 0.01),
                                          np.arange(me - 0.05, me + 0.051, 0.01)))
            per_gpu[gpu] = best(gpu, overhead, [(c, m) for c, m in fine if 0 < c <= 1 and 0 < m <= 1])
        fits[overhead] = per_gpu
    overhead = min(fits, key=lambda o: sum(score for score, _, _ in fits[o].values()))
    print(f"kernel_overhead_s: {overhead:.1e}   (cost_model=roofline default)")
    for gpu, (score, ce, me) in fits[overhead].items():
        print(f"{gpu}: compute_efficiency {ce:.2f}, memory_efficiency {me:.2f} (objective {score:.3f})")
    for gpu, name in NETWORKS.items():
        latency, efficiency, score = calibrate_all_reduce(gpu, name)
        print(f"{gpu}: interconnect_latency_s {latency:.1e}, interconnect_efficiency {efficiency:.2f} "
              f"(mean |log error| {score:.3f}, intra-node all-reduces)")


def calibrate_all_reduce(gpu: str, name: str) -> tuple[float, float, float]:
    """(latency, efficiency, mean |log error|) fitting the intra-node all-reduces of ``name``."""
    table = load_table(next(p for p in shipped_tables() if p.name == name))
    hw = hardware(gpu)
    points = [(s.where["num_devices"], b, m) for s in table.series
              if s.where["num_devices"] == s.where["devices_per_node"] for b, m in zip(s.grid[0], s.seconds)]
    devices, nbytes, measured = (np.array(v) for v in zip(*points))
    best = None
    for latency in np.arange(1, 101, 1) * 1e-6:
        for efficiency in np.arange(0.20, 1.001, 0.01):
            predicted = latency + 2 * (devices - 1) / devices * nbytes / (hw.interconnect_bandwidth * efficiency)
            score = np.abs(np.log(predicted / measured)).mean()
            if best is None or score < best[2]:
                best = (latency, efficiency, score)
    return best


def errors(predicted, measured) -> tuple[float, float, float]:
    """Median |error|, worst |error| and median signed error of predicted vs measured."""
    relative = [p / m - 1 for p, m in zip(predicted, measured)]
    return (statistics.median(abs(r) for r in relative), max(abs(r) for r in relative), statistics.median(relative))


def pct(value: float) -> str:
    return f"{100 * value:+.1f}%" if value < 0 or value > 0 else "0.0%"


def operator_report() -> None:
    """Per-layer error by hardware, model and TP; per-operator error by hardware and model."""
    print("### Roofline vs measured operators (per layer, attention excluded)\n")
    print("| hardware | model | TP | token counts | per-layer median error | per-layer worst | per-layer bias |")
    print("|---|---|---|---|---|---|---|")
    by_op = {}
    for gpu, preset in itertools.product(GPUS, MODELS):
        hw = hardware(gpu)
        rows = list(operator_points(gpu, preset))
        for tp in sorted({r[0] for r in rows}):
            model = RooflineCostModel(RooflineCostModelConfig(), context(preset, hw, tp))
            layers_p, layers_m = {}, {}
            for _, n, name, _, _, measured in (r for r in rows if r[0] == tp):
                predicted = dict(model.dense_times(n))[name]
                layers_p[n] = layers_p.get(n, 0.0) + predicted
                layers_m[n] = layers_m.get(n, 0.0) + measured
                by_op.setdefault((gpu, preset, name), ([], []))
                by_op[(gpu, preset, name)][0].append(predicted)
                by_op[(gpu, preset, name)][1].append(measured)
            median, worst, bias = errors(list(layers_p.values()), list(layers_m.values()))
            print(f"| {gpu} | {preset} | {tp} | {len(layers_m)} ({min(layers_m)}-{max(layers_m)}) | "
                  f"{100 * median:.1f}% | {100 * worst:.1f}% | {pct(bias)} |")
    print("\n### Roofline vs measured, per operator (all TP degrees and token counts)\n")
    print("| operator | " + " | ".join(f"{GPUS[g]} {p.removeprefix('llama-2-')} median / worst / bias"
                                      for g, p in itertools.product(GPUS, MODELS)) + " |")
    print("|---|" + "---|" * (len(GPUS) * len(MODELS)))
    for name in LAYER_OPERATORS:
        cells = []
        for gpu, preset in itertools.product(GPUS, MODELS):
            median, worst, bias = errors(*by_op[(gpu, preset, name)])
            cells.append(f"{100 * median:.0f}% / {100 * worst:.0f}% / {pct(bias)}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def collective_report() -> None:
    """The roofline's ring all-reduce against the DGX tables."""
    print("\n### Roofline ring all-reduce vs measured (DGX, 2 KiB to 64 MiB)\n")
    print("| hardware | devices | per node | median error | worst | bias |")
    print("|---|---|---|---|---|---|")
    for gpu, name in NETWORKS.items():
        hw = hardware(gpu)
        table = load_table(next(p for p in shipped_tables() if p.name == name))
        for series in table.series:
            devices, per_node = series.where["num_devices"], series.where["devices_per_node"]
            node_hw = replace(hw, devices_per_node=per_node)
            predicted = [all_reduce_time(b, devices, node_hw) for b in series.grid[0]]
            median, worst, bias = errors(predicted, series.seconds)
            print(f"| {gpu} | {devices} | {per_node} | {100 * median:.1f}% | {100 * worst:.1f}% | {pct(bias)} |")


def end_to_end_report() -> None:
    """Batch-1 step times of both cost models against published latencies on A100 80GB."""
    print("\n### Batch-1 step times vs published latencies (A100 80GB SXM, 16-bit)\n")
    print("| what | model | TP | published ms | roofline ms | error | profiled ms | error | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    hw = hardware("a100-80gb")
    for what, preset, tp, batch, cited, source in PUBLISHED:
        ctx = context(preset, hw, tp)
        roof = RooflineCostModel(RooflineCostModelConfig(), ctx).forward_cost(batch).total * 1000
        prof = ProfiledCostModel(ProfiledCostModelConfig(), ctx).forward_cost(batch).total * 1000
        print(f"| {what} | {preset} | {tp} | {cited:.1f} | {roof:.1f} | {pct(roof / cited - 1)} | {prof:.1f} | "
              f"{pct(prof / cited - 1)} | {source} |")
    print()
    for key, text in SOURCES.items():
        print(f"- {key}: {text}")


CPU_METRICS = (("TTFT P50 ms", "ttft_ms", "p50"), ("TTFT P90 ms", "ttft_ms", "p90"), ("TPOT P50 ms", "tpot_ms", "p50"),
               ("TPOT P99 ms", "tpot_ms", "p99"), ("output tok/s", "output_throughput", None))


def cpu_report(folder: str) -> None:
    """Real vs simulated runs: ``folder/<case>/real-*/metrics.json`` (repeats of a real
    run) and ``folder/<case>/sim-*/metrics.json`` (the same command with executor=simulated
    cost_model=profiled hardware=local, each with the table profiled just before the real
    run of the same round): per case and metric, the medians and their error."""
    import json
    from pathlib import Path

    def value(metrics: dict, key: str, stat: str | None) -> float:
        return metrics[key] if stat is None else metrics[key][stat]

    print("| case | metric | real runs | real median | simulated runs | simulated median | error |")
    print("|---|---|---|---|---|---|---|")
    errors_seen = []
    for case in sorted(p for p in Path(folder).iterdir() if list(p.glob("sim*/metrics.json"))):
        reals = [json.loads(p.read_text()) for p in sorted(case.glob("real-*/metrics.json"))]
        sims = [json.loads(p.read_text()) for p in sorted(case.glob("sim*/metrics.json"))]
        for label, key, stat in CPU_METRICS:
            runs, simulated = [value(m, key, stat) for m in reals], [value(m, key, stat) for m in sims]
            error = statistics.median(simulated) / statistics.median(runs) - 1
            errors_seen.append(abs(error))
            print(f"| {case.name} | {label} | {', '.join(f'{r:.1f}' for r in runs)} | {statistics.median(runs):.1f} | "
                  f"{', '.join(f'{r:.1f}' for r in simulated)} | {statistics.median(simulated):.1f} | {pct(error)} |")
    within = sum(e <= 0.15 for e in errors_seen)
    print(f"\n{within} of {len(errors_seen)} within 15%; median |error| {100 * statistics.median(errors_seen):.1f}%, "
          f"worst {100 * max(errors_seen):.1f}%")


def main() -> None:
    """``calibrate``, ``report`` or ``cpu FOLDER``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("calibrate", "report", "cpu"))
    parser.add_argument("folder", nargs="?", help="cpu: the folder of real and simulated runs")
    args = parser.parse_args()
    if args.what == "calibrate":
        calibrate()
    elif args.what == "cpu":
        cpu_report(args.folder)
    else:
        operator_report()
        collective_report()
        end_to_end_report()


if __name__ == "__main__":
    main()
