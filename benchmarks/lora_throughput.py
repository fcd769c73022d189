"""Multi-LoRA serving on this CPU at toy scale: requests spread over many adapters, served
in one engine (adapters paged through slots, every step mixing them) against merging
one adapter at a time into the base weights and serving its requests alone, and
against the base model without adapters.

The model is the shipped ``tiny`` Llama (float32); each adapter is a random PEFT LoRA
of rank ``--rank`` on every projection. Every request has ``--prompt`` random tokens
and generates ``--output`` tokens greedily (EOS ignored); all requests arrive at once.
With ``--slots`` slots the engine runs with adapter-aware admission off and on, and with
the unified pool; with a slot per adapter, no paging at all. Those multi-LoRA engines run
in turn, one run each per round, so that a shared machine's load falls on each alike.
Each engine is warmed up first; each time is the best of ``--repeats`` runs on
``--threads`` torch threads (default one: the machine is shared, and a busy core stalls
every thread of a multi-threaded matmul). Prints the markdown table of docs/results/lora.md.

    python benchmarks/lora_throughput.py [--adapters 1,8,64,256] [--requests 256] [--slots 16]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from servelab import LLM, SamplingParams
from servelab.core.config import checkpoint_path

SYSTEMS = ("base model", "multi-LoRA, admission off", "multi-LoRA", "multi-LoRA, unified pool",
           "multi-LoRA, slot per adapter", "merge one at a time")
SLOT_LIMITED = {"multi-LoRA, admission off": ["lora.admission=false"], "multi-LoRA": [],
                "multi-LoRA, unified pool": ["lora.unified_pool=true"]}
"""The systems with ``--slots`` slots and their settings; their runs alternate."""


def make_adapters(base: str, count: int, rank: int, folder: Path) -> dict[str, str]:
    """``count`` random adapters of ``base``: one saved by PEFT, the others its files with
    fresh random tensors (B non-zero, so each changes the model)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    first = folder / "adapter0"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False))
    model.save_pretrained(first)
    tensors = load_file(first / "adapter_model.safetensors")
    folders = {"adapter0": str(first)}
    for index in range(1, count):
        target = folder / f"adapter{index}"
        target.mkdir()
        shutil.copy(first / "adapter_config.json", target)
        save_file({key: torch.randn_like(t) * t.std() for key, t in tensors.items()},
                  target / "adapter_model.safetensors")
        folders[f"adapter{index}"] = str(target)
    return folders


def workload(num_requests: int, prompt_len: int, names: list[str], seed: int = 0) -> tuple[list, list]:
    """Random prompts and, per prompt, an adapter drawn uniformly from ``names``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 250) for _ in range(prompt_len)] for _ in range(num_requests)]
    return prompts, [rng.choice(names) for _ in range(num_requests)]


def timed_generate(llm: LLM, prompts: list, params: SamplingParams, lora) -> tuple[float, int]:
    """Seconds and output tokens of one ``generate``."""
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora=lora)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outputs)


def best_of(repeats: int, run) -> tuple[float, int]:
    """The fastest of ``repeats`` runs of ``run()`` (seconds, tokens)."""
    return min((run() for _ in range(repeats)), key=lambda result: result[0])


def merged_one_at_a_time(llm: LLM, adapters: dict[str, str], prompts: list, loras: list,
                         params: SamplingParams) -> tuple[float, int]:
    """For each adapter: add B @ A into the base weights, serve its requests, subtract it
    again; the time includes the merges (and the repacking of the changed weights)."""
    from servelab.plugins.models.lora_targets import lora_placements

    engine, slots = llm.engine, llm.engine.executor.lora
    started, tokens = time.perf_counter(), 0
    for name in adapters:
        mine = [p for p, lora in zip(prompts, loras) if lora == name]
        if not mine:
            continue
        placements = lora_placements(slots.model, slots.layers, engine.lora_adapter(name))
        with torch.no_grad():
            for sign in (1, -1):
                for placement in placements:
                    weight = slots.layers[placement.layer].base.weight
                    rows = slice(placement.first_row, placement.first_row + placement.b.shape[0])
                    weight[rows] += sign * (placement.b @ placement.a)
                if sign == 1:
                    tokens += timed_generate(llm, mine, params, None)[1]
    return time.perf_counter() - started, tokens


def measure(num_adapters: int, args: argparse.Namespace, root: Path) -> dict[str, dict]:
    """Every system on one workload over ``num_adapters`` adapters."""
    base = checkpoint_path("tiny")
    adapters = make_adapters(base, num_adapters, args.rank, root / f"n{num_adapters}")
    prompts, loras = workload(args.requests, args.prompt, list(adapters))
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    listed = ", ".join(f"{name}: '{path}'" for name, path in adapters.items())
    common = ["model.dtype=float32", "device=cpu", f"scheduler.max_num_seqs={args.requests}"]
    results = {}
    llm = LLM(base, overrides=common)
    llm.warm_up()
    seconds, tokens = best_of(args.repeats, lambda: timed_generate(llm, prompts, params, None))
    results["base model"] = dict(seconds=seconds, tokens=tokens)
    llm.shutdown()
    def engine(slots: int, *extra: str) -> LLM:
        llm = LLM(base, overrides=[*common, f"lora.adapters={{{listed}}}", f"lora.max_rank={args.rank}",
                                   f"lora.max_adapters={slots}", *extra])
        llm.warm_up()
        llm.generate(prompts[:4], params, use_tqdm=False, lora=loras[:4])
        return llm

    engines = {system: engine(args.slots, *extra) for system, extra in SLOT_LIMITED.items()}
    if num_adapters > args.slots:
        engines["multi-LoRA, slot per adapter"] = engine(num_adapters)
    before = {system: paging(llm) for system, llm in engines.items()}
    runs: dict[str, list[tuple[float, int]]] = {system: [] for system in engines}
    for _ in range(args.repeats):  # alternating, so that the machine's load falls on every system alike
        for system, llm in engines.items():
            runs[system].append(timed_generate(llm, prompts, params, loras))
    for system, llm in engines.items():
        seconds, tokens = min(runs[system], key=lambda result: result[0])
        after = paging(llm)
        results[system] = dict(seconds=seconds, tokens=tokens, slots=llm.engine.executor.lora_stats().slots,
                               **{key: (after[key] - before[system][key]) / args.repeats for key in after})
    llm = engines["multi-LoRA"]
    seconds, tokens = best_of(args.repeats, lambda: merged_one_at_a_time(llm, adapters, prompts, loras, params))
    results["merge one at a time"] = dict(seconds=seconds, tokens=tokens)
    for llm in engines.values():
        llm.shutdown()
    return results


def paging(llm: LLM) -> dict[str, float]:
    """The engine's adapter paging counters so far (slots, and the unified pool's when it has one)."""
    stats = llm.engine.executor.lora_stats()
    counters = dict(hits=stats.hits, misses=stats.misses, split_steps=stats.split_steps,
                    load_seconds=stats.load_seconds, steps=llm.engine.num_steps)
    admission = llm.engine.adapter_admission
    if admission is not None and admission.pool is not None:
        counters["pressure_evictions"] = admission.pool.stats.pressure_evictions
    return counters


def table(all_results: dict[int, dict]) -> str:
    """The markdown table: throughput per system, relative to the base model."""
    lines = ["| adapters | system | slots | output tok/s | x base model | adapter hit rate | loads per run | "
             "load ms per run | split steps | steps per run |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for count, results in all_results.items():
        base = results["base model"]["tokens"] / results["base model"]["seconds"]
        for system in SYSTEMS:
            if system not in results:
                continue
            r = results[system]
            rate = r["tokens"] / r["seconds"]
            uses = r.get("hits", 0) + r.get("misses", 0)
            paging = (f"{r['hits'] / uses:.2f} | {r['misses']:.0f} | {1000 * r['load_seconds']:.0f} | "
                      f"{r['split_steps']:.0f} | {r['steps']:.0f}"
                      if uses else " | | | | ")
            lines.append(f"| {count} | {system} | {r.get('slots', '')} | {rate:.0f} | {rate / base:.2f} | {paging} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", default="1,8,64,256", help="adapter counts, comma-separated")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        results = {count: measure(count, args, Path(folder)) for count in map(int, args.adapters.split(","))}
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
