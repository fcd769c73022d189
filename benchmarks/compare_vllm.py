"""servelab against vLLM on the same CPU, models and offline workload, as ratios.

Models: ``servelab.bench.random_llama`` (random-weight Llama 26m and 3m, vocabulary 2048,
05b in the shape of Qwen2.5-0.5B, and moe05b, a Qwen3-MoE of 0.46B parameters).
Workload: ``servelab-bench``'s ``offline`` preset (256 requests, prompt lengths uniform in
[16, 256], random token ids, seed 0, 128 output tokens each with ignore_eos, greedy, all
submitted at once), written to a workload file both engines read.

Each engine runs in its own fresh process, one after the other, through the same
procedure (``servelab.bench.offline_run``: warm-up, one timed ``generate``); vLLM runs with
the Python of its own environment (``--vllm-python``, ``benchmarks/vllm_offline.py``),
servelab with this one.

    python benchmarks/compare_vllm.py --vllm-python /path/to/vllm-venv/bin/python \\
        --models 26m 3m --dtypes float32 bfloat16 --repeats 3 \\
        --out docs/results/compare_vllm.json --label "AO: what changed, 3 repeats"

``--out`` appends one entry per (model, dtype) to that list of runs: the label, every
run's tokens/s per engine, and whether the first greedy outputs agree.

Quantized weights: servelab's come from ``--overrides`` (``model.quantization=w8a8``);
``--vllm-quantization w8a8`` gives vLLM the same int8 weights as a compressed-tensors
checkpoint (``servelab.bench.compressed_tensors``: int8 per channel, int8 activations per
token), and ``--vllm-dtype`` its activation dtype when it differs from servelab's:

    python benchmarks/compare_vllm.py --vllm-python /path/to/vllm-venv/bin/python --models 05b \
        --requests 64 --output-tokens 64 --dtypes float32 --vllm-dtype bfloat16 --vllm-quantization w8a8 \
        --overrides attention=cpu model.quantization=w8a8 model.quantization_lm_head=true

This machine's speed drifts by tens of percent from minute to minute, so ``--repeats``
alternates the engines and the table reports medians (and every run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from servelab.bench.baselines.vllm_engine import VLLM_CPU_ENV
from servelab.bench.compressed_tensors import write_w8a8_checkpoint
from servelab.bench.offline_run import run_servelab, write_comparison_workload
from servelab.bench.random_llama import MODELS, make_checkpoint
from servelab.bench.report import markdown_header, markdown_row

HERE = os.path.dirname(os.path.abspath(__file__))


def in_fresh_process(command: list[str], env: dict | None = None) -> dict:
    """Run a command that prints a JSON line starting with {"engine"; return it."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{result.stderr[-3000:]}")
    line = next(line for line in reversed(result.stdout.splitlines()) if line.startswith('{"engine"'))
    return json.loads(line)


def tokens_per_second(runs: list[dict]) -> list[float]:
    """Output tokens per second of each run."""
    return [run["output_tokens"] / run["seconds"] for run in runs]


def append_results(path: str, label: str, rows: list[dict]) -> None:
    """Append ``rows`` to the results list at ``path`` (created if missing) as entries of
    ``run`` (the label), ``model``, ``dtype``, ``servelab_tok_s``, ``vllm_tok_s`` and
    ``first_outputs_equal``, ``servelab_overrides`` and ``vllm_setting``."""
    results = []
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    for row in rows:
        results.append({"run": label, "model": row["model"], "dtype": row["dtype"],
                        "servelab_tok_s": [round(x, 1) for x in tokens_per_second(row["servelab"])],
                        "vllm_tok_s": [round(x, 1) for x in tokens_per_second(row["vllm"])],
                        "first_outputs_equal": row["first_outputs_equal"],
                        "servelab_overrides": row["servelab_overrides"], "vllm_setting": row["vllm_setting"]})
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    """Run every (model, dtype) for both engines and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment with vLLM (omit to run servelab only)")
    parser.add_argument("--models", nargs="+", default=["26m", "3m"], choices=sorted(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--overrides", nargs="*", default=["attention=cpu"], help="servelab Hydra overrides")
    parser.add_argument("--vllm-dtype", help="vLLM's dtype (default: the row's --dtypes entry)")
    parser.add_argument("--vllm-quantization", choices=["none", "w8a8"], default="none",
                        help="w8a8: vLLM loads an int8 compressed-tensors copy of the model")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per engine, alternating servelab and vLLM; the table shows medians")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare"))
    parser.add_argument("--out", help="append the rows to this JSON list of runs (docs/results/compare_vllm.json)")
    parser.add_argument("--label", default="unlabelled", help="the rows' run label in --out")
    parser.add_argument("--servelab-worker", nargs=3, metavar=("FOLDER", "WORKLOAD", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.servelab_worker:
        print(json.dumps(run_servelab(*args.servelab_worker, args.overrides)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    workload = write_comparison_workload(os.path.join(args.workdir, "workload.json"), args.requests,
                                         args.output_tokens)
    rows = []
    print(markdown_header(["model", "dtype", "vLLM setting", "servelab tok/s", "vLLM tok/s", "ratio", "servelab runs",
                           "vLLM runs", "first outputs equal"], align="lllrrrlll"))
    for name in args.models:
        folder = make_checkpoint(os.path.join(args.workdir, name), name)
        vllm_folder = folder
        if args.vllm_quantization == "w8a8":
            vllm_folder = write_w8a8_checkpoint(folder, os.path.join(args.workdir, f"{name}-w8a8"))
        for dtype in args.dtypes:
            vllm_dtype = args.vllm_dtype or dtype
            vllm_setting = vllm_dtype if args.vllm_quantization == "none" else f"{vllm_dtype} {args.vllm_quantization}"
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(in_fresh_process([sys.executable, __file__, "--servelab-worker", folder, workload, dtype,
                                              "--overrides", *args.overrides]))
                if args.vllm_python:
                    theirs.append(in_fresh_process([args.vllm_python, os.path.join(HERE, "vllm_offline.py"),
                                                    vllm_folder, workload, vllm_dtype],
                                                   dict(os.environ, **VLLM_CPU_ENV)))
            same = bool(theirs) and theirs[0]["first_outputs"] == ours[0]["first_outputs"]
            rows.append({"model": name, "dtype": dtype, "vllm_setting": vllm_setting, "servelab_overrides": args.overrides,
                         "servelab": ours, "vllm": theirs, "first_outputs_equal": same})
            ours_tps, theirs_tps = tokens_per_second(ours), tokens_per_second(theirs) or [float("nan")]
            ours_median, theirs_median = statistics.median(ours_tps), statistics.median(theirs_tps)
            print(markdown_row([name, dtype, vllm_setting, f"{ours_median:.1f}", f"{theirs_median:.1f}",
                                f"{ours_median / theirs_median:.2f}x", " ".join(f"{x:.0f}" for x in ours_tps),
                                " ".join(f"{x:.0f}" for x in theirs_tps), str(same)]), flush=True)
    if args.out:
        append_results(args.out, args.label, rows)


if __name__ == "__main__":
    main()
