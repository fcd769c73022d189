"""KV waste and the largest batch that fits a fixed KV budget, with and without KV cache
groups: simulated Gemma-3-27B, Mistral-7B and DeepSeek-V2-Lite at paper scale, and tiny
random Gemma 3 and Mistral checkpoints run for real on this CPU.

Every row is one ``servelab-bench`` job; the script prints the markdown table of
docs/results/kv_cache_groups.md and each job's command.

    python benchmarks/kv_cache_groups.py [--out DIR] [--only sim|real]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 2 ** 30
SIMULATED = {
    "gemma-3-27b": ("executor=simulated cost_model=roofline model=gemma-3-27b hardware=a100-80gb "
                    "model.max_model_len=8192 workload.input_range=[4096,4096] workload.output_range=[256,256] "
                    f"cache.memory_bytes={8 * GIB}"),
    "mistral-7b": ("executor=simulated cost_model=roofline model=mistral-7b hardware=a100-80gb "
                   "model.max_model_len=16384 workload.input_range=[12288,12288] workload.output_range=[256,256] "
                   f"cache.memory_bytes={8 * GIB}"),
    "deepseek-v2-lite": ("executor=simulated cost_model=roofline model=deepseek-v2-lite hardware=a100-80gb "
                         "model.max_model_len=8192 workload.input_range=[4096,4096] "
                         f"workload.output_range=[256,256] cache.memory_bytes={4 * GIB}"),
}
VARIANTS = {
    "gemma-3-27b": {"groups": "cache.groups=true", "one group": "cache.groups=false"},
    "mistral-7b": {"groups": "cache.groups=true", "one group": "cache.groups=false"},
    "deepseek-v2-lite": {"latent (MLA), stored once": "", "multi-head K, V of 16 x 160": (
        "model.shape.architecture=LlamaForCausalLM model.shape.latent=null model.shape.experts=null "
        "model.shape.head_dim=160 model.shape.intermediate_size=11264")},
}
COMMON = "workload=offline workload.num_requests=64 scheduler=chunked"
REAL_FAMILIES = {"gemma3": "tiny Gemma 3 (windows of 8, layers local/global/local)",
                 "mistral": "tiny Mistral (window 16, every layer)"}
REAL = ("model=local model.dtype=float32 model.max_model_len=256 workload=offline workload.num_requests=128 "
        "workload.input_range=[160,160] workload.output_range=[32,32] cache.block_size=8 "
        "cache.memory_bytes=1000000 scheduler=chunked scheduler.token_budget=512")


def run(args: str, folder: Path) -> dict:
    """One servelab-bench job; its metrics.json."""
    command = ["servelab-bench", *shlex.split(args), f"hydra.run.dir={folder}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / "metrics.json").read_text())


def row(name: str, variant: str, metrics: dict) -> str:
    """A markdown row: waste, the largest batch, preemptions, throughput."""
    system = metrics["system"]
    return (f"| {name} | {variant} | {100 * system['kv_waste']:.1f} | {system['peak_running']} | "
            f"{metrics['preemptions']} | {metrics['output_throughput']:.1f} | {metrics['tpot_ms']['mean']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="kv-groups-")))
    parser.add_argument("--only", choices=("sim", "real"))
    options = parser.parse_args()
    rows, commands = [], []
    if options.only != "real":
        for name, base in SIMULATED.items():
            for variant, extra in VARIANTS[name].items():
                args = f"{base} {COMMON} {extra}".strip()
                commands.append(f"servelab-bench {args}")
                rows.append(row(name, variant, run(args, options.out / f"{name}-{len(rows)}")))
    if options.only != "sim":
        from servelab.testing import tiny_checkpoint

        for family, label in REAL_FAMILIES.items():
            folder = tiny_checkpoint(options.out / f"ckpt-{family}", family,
                                     **({"sliding_window": 16} if family == "mistral" else {}))
            for variant, extra in (("groups", "cache.groups=true"), ("one group", "cache.groups=false")):
                args = f"{REAL} model.path={folder} {extra}"
                commands.append(f"servelab-bench {args}")
                rows.append(row(label, variant, run(args, options.out / f"{family}-{len(rows)}")))
    print("| model | cache | KV waste % | largest batch | preemptions | output tok/s | TPOT mean ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\n" + "\n".join(commands), file=sys.stderr)


if __name__ == "__main__":
    main()
