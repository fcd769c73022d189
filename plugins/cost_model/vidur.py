"""Convert Vidur's measured operator and all-reduce tables into servelab cost tables.

Vidur (microsoft/vidur, MIT license) publishes per-layer operator times of Llama-2-7B/70B
on A100 and H100 at tensor parallelism 1-8 (``compute/<gpu>/<model>/mlp.csv``) and NCCL
all-reduce times on DGX nodes (``network/<gpu>_dgx/all_reduce.csv``). This writes each as
one table (``table.py``'s format), the median of duplicate rows' ``time_stats.<op>.median``,
milliseconds turned into seconds, and copies Vidur's license beside them::

    python -m servelab.plugins.cost_model.vidur /path/to/vidur/data plugins/cost_model/tables

Vidur's all-reduce ``size`` column is bytes: its profiler records ``size * 2`` of a float16
buffer of ``size`` elements (``vidur/profiling/collectives/collectives_wrapper.py``).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
from collections import defaultdict
from pathlib import Path

from servelab.plugins.cost_model.operators import LAYER_OPERATORS
from servelab.plugins.cost_model.table import CostTable, Series, save_table

GPUS = {"a100": ("a100-80gb",), "h100": ("h100-80gb",)}
"""Vidur's compute profiles: A100 80GB SXM and H100 80GB SXM (its device configs)."""
NETWORKS = {"a100_dgx": ("a100-80gb", "a100-40gb"), "h100_dgx": ("h100-80gb",)}
"""DGX all-reduce profiles; both A100 SXM variants share the DGX A100's NVLink 3 switch."""
OPERATORS = ("emb", *LAYER_OPERATORS)
SOURCE = "Vidur (github.com/microsoft/vidur), data/profiling"
LICENSE = "MIT License, Copyright (c) Microsoft Corporation; see LICENSE-vidur beside this file"


def _medians(rows: list[dict[str, str]], key: tuple[str, ...], column: str) -> dict[tuple, float]:
    """Median of ``column`` (ms) over rows sharing ``key``'s values, in seconds."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        if row.get(column, "") != "":
            groups[tuple(float(row[k]) for k in key)].append(float(row[column]))
    return {k: round(statistics.median(v) / 1000.0, 9) for k, v in groups.items()}


def operator_table(csv_path: Path, gpu: str, model: str) -> CostTable:
    """One ``mlp.csv`` as an ``operators`` table: a series per operator and TP degree."""
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    first = rows[0]
    heads, hidden = int(first["n_head"]), int(first["n_embd"])
    sizes = {"hidden_size": hidden, "num_heads": heads, "num_kv_heads": int(first["n_kv_head"]),
             "head_dim": hidden // heads, "intermediate_size": int(first["n_expanded_embd"])}
    series = []
    for op in OPERATORS:
        times = _medians(rows, ("num_tensor_parallel_workers", "num_tokens"), f"time_stats.{op}.median")
        for tp in sorted({int(t) for t, _ in times}):
            points = sorted((n, s) for (t, n), s in times.items() if int(t) == tp)
            series.append(Series(op, ("num_tokens",), (tuple(int(n) for n, _ in points),), [s for _, s in points],
                                 {"tensor_parallel_size": tp}))
    meta = {"source": f"{SOURCE}/compute/{gpu}/{model}/mlp.csv", "license": LICENSE, "model_name": model,
            "profiled_vocab_size": int(first["vocab_size"]), "gated_mlp": first["use_gated_mlp"] == "True",
            "what": "per-layer operator times on one GPU (CUDA events), medians; attention is not included"}
    return CostTable("operators", GPUS[gpu], tuple(series), sizes, "float16", meta)


def collective_table(csv_path: Path, network: str) -> CostTable:
    """One ``all_reduce.csv`` as a ``collectives`` table: a series per (devices, devices per node)."""
    with open(csv_path, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["collective"] == "all_reduce"]
    times = _medians(rows, ("num_workers", "devices_per_node", "size"), "time_stats.all_reduce.median")
    series = []
    for devices, per_node in sorted({(int(w), int(d)) for w, d, _ in times}):
        points = sorted((b, s) for (w, d, b), s in times.items() if (int(w), int(d)) == (devices, per_node))
        series.append(Series("all_reduce", ("bytes",), (tuple(int(b) for b, _ in points),), [s for _, s in points],
                             {"num_devices": devices, "devices_per_node": per_node}))
    meta = {"source": f"{SOURCE}/network/{network}/all_reduce.csv", "license": LICENSE,
            "what": "NCCL all-reduce kernel times of a float16 buffer of `bytes` bytes, medians"}
    return CostTable("collectives", NETWORKS[network], tuple(series), {}, "float16", meta)


def convert(vidur_data: Path, out: Path) -> list[Path]:
    """Write every table found under ``vidur_data`` (Vidur's ``data/`` or our copy) into ``out``."""
    written = []
    for gpu in GPUS:
        for model_dir in sorted((vidur_data / "compute" / gpu).glob("*")):
            if (model_dir / "mlp.csv").exists():
                name = model_dir.name.lower().removesuffix("-hf")
                written.append(save_table(operator_table(model_dir / "mlp.csv", gpu, model_dir.name),
                                          out / f"vidur-{gpu}-{name}.json"))
    for network in NETWORKS:
        path = vidur_data / "network" / network / "all_reduce.csv"
        if path.exists():
            written.append(save_table(collective_table(path, network),
                                      out / f"vidur-{network.replace('_', '-')}-all-reduce.json"))
    license_file = vidur_data / "LICENSE"
    if license_file.exists():
        shutil.copyfile(license_file, out / "LICENSE-vidur")
    return written


def main() -> None:
    """``python -m servelab.plugins.cost_model.vidur VIDUR_DATA OUT``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("vidur_data", type=Path, help="Vidur's data/ folder (compute/, network/, LICENSE)")
    parser.add_argument("out", type=Path, help="where to write the tables")
    args = parser.parse_args()
    for path in convert(args.vidur_data, args.out):
        print(path)


if __name__ == "__main__":
    main()
