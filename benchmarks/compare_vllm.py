"""servelab against vLLM on the same CPU, models and offline workload, as ratios.

Models (random weights, seed 0, Llama architecture, vocabulary 2048, float32 files):
  26m: hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1536, untied embeddings
  3m:  hidden 256, 4 layers, 8 heads, 4 KV heads, intermediate 688, tied embeddings
Workload: 256 requests, prompt lengths uniform in [16, 256] (random token ids, seed 0),
128 output tokens each with ignore_eos, greedy, all submitted at once.

Each engine runs in its own fresh process, one after the other; vLLM runs with the
Python of its own environment (``--vllm-python``), servelab with this one.

    python benchmarks/compare_vllm.py --vllm-python /path/to/vllm-venv/bin/python \\
        --models 26m 3m --dtypes float32 bfloat16 --repeats 3 --out docs/results/compare_vllm.json

This machine's speed drifts by tens of percent from minute to minute, so ``--repeats``
alternates the engines and the table reports medians (and every run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    "26m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=1536, tie_word_embeddings=False),
    "3m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
               intermediate_size=688, tie_word_embeddings=True),
}
VOCAB = 2048
HERE = os.path.dirname(os.path.abspath(__file__))


def word_tokenizer(vocab_size: int):
    """A tokenizer whose every id decodes (``<i>`` words), so both engines detokenize."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<0>", bos_token="<0>", eos_token="<1>")


def make_checkpoint(folder: str, name: str) -> str:
    """Write the named random model (seed 0) and its tokenizer once."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                         **MODELS[name])
    LlamaForCausalLM(config).save_pretrained(folder)
    word_tokenizer(VOCAB).save_pretrained(folder)
    return folder


def make_workload(path: str, num_requests: int, output_tokens: int, seed: int = 0) -> str:
    """The prompts and limits, as JSON both engines read."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(16, 256))] for _ in range(num_requests)]
    with open(path, "w") as f:
        json.dump({"prompts": prompts, "output_tokens": output_tokens, "max_model_len": 512,
                   "max_num_seqs": num_requests}, f)
    return path


def run_servelab(folder: str, workload_path: str, dtype: str, overrides: list[str]) -> dict:
    """servelab's offline generate over the workload (called in a fresh process)."""
    from servelab import LLM, SamplingParams

    with open(workload_path) as f:
        workload = json.load(f)
    llm = LLM(folder, overrides=[f"model.dtype={dtype}", f"model.max_model_len={workload['max_model_len']}",
                                 f"scheduler.max_num_seqs={workload['max_num_seqs']}", *overrides])
    params = SamplingParams(temperature=0.0, max_tokens=workload["output_tokens"], ignore_eos=True)
    llm.warm_up()
    llm.generate(workload["prompts"][:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(workload["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {"engine": "servelab", "seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "first_outputs": [o.outputs[0].token_ids for o in outputs[:8]]}


def in_fresh_process(command: list[str], env: dict | None = None) -> dict:
    """Run a command that prints a JSON line starting with {"engine"; return it."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{result.stderr[-3000:]}")
    line = next(l for l in reversed(result.stdout.splitlines()) if l.startswith('{"engine"'))
    return json.loads(line)


def main() -> None:
    """Run every (model, dtype) for both engines and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment with vLLM (omit to run servelab only)")
    parser.add_argument("--models", nargs="+", default=["26m", "3m"], choices=sorted(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--overrides", nargs="*", default=["attention=cpu"], help="servelab Hydra overrides")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per engine, alternating servelab and vLLM; the table shows medians")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servelab-compare"))
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--servelab-worker", nargs=3, metavar=("FOLDER", "WORKLOAD", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.servelab_worker:
        print(json.dumps(run_servelab(*args.servelab_worker, args.overrides)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    workload = make_workload(os.path.join(args.workdir, "workload.json"), args.requests, args.output_tokens)
    rows = []
    print("| model | dtype | servelab tok/s | vLLM tok/s | ratio | servelab runs | vLLM runs | first outputs equal |")
    print("|---|---|---:|---:|---:|---|---|---|")
    for name in args.models:
        folder = make_checkpoint(os.path.join(args.workdir, name), name)
        for dtype in args.dtypes:
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(in_fresh_process([sys.executable, __file__, "--servelab-worker", folder, workload, dtype,
                                              "--overrides", *args.overrides]))
                if args.vllm_python:
                    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4")
                    theirs.append(in_fresh_process([args.vllm_python, os.path.join(HERE, "vllm_offline.py"), folder,
                                                    workload, dtype], env))
            rows.append({"model": name, "dtype": dtype, "servelab": ours, "vllm": theirs})
            ours_tps = [run["output_tokens"] / run["seconds"] for run in ours]
            theirs_tps = [run["output_tokens"] / run["seconds"] for run in theirs] or [float("nan")]
            same = bool(theirs) and theirs[0]["first_outputs"] == ours[0]["first_outputs"]
            ours_median, theirs_median = statistics.median(ours_tps), statistics.median(theirs_tps)
            print(f"| {name} | {dtype} | {ours_median:.1f} | {theirs_median:.1f} | {ours_median / theirs_median:.2f}x | "
                  f"{' '.join(f'{x:.0f}' for x in ours_tps)} | {' '.join(f'{x:.0f}' for x in theirs_tps)} | {same} |",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
