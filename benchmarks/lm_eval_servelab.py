"""lm-evaluation-harness against ``servelab-serve``, on two local tasks, checked offline.

Starts ``servelab-serve`` (default model unless ``--overrides`` say otherwise) and runs
lm-evaluation-harness's ``local-completions`` model (from its own virtual environment)
on the tasks of ``benchmarks/lm_eval_tasks/`` (no download):

- ``servelab_python_next_line`` (multiple choice, acc / acc_norm): which of four lines
  follows six lines of held-out Python;
- ``servelab_python_files`` (loglikelihood_rolling: word / byte perplexity, bits per byte)
  over 24 held-out file openings.

Then it scores the same requests offline with ``LLM.generate(prompt_logprobs=0)``, tokenized
as the harness tokenizes them, and reports both: the harness's numbers must equal the
engine's own. lm-eval in a virtual environment of its own:

    python -m venv /path/to/lmeval-venv && /path/to/lmeval-venv/bin/pip install "lm_eval[api]" transformers
    python benchmarks/lm_eval_servelab.py --lm-eval /path/to/lmeval-venv/bin/lm_eval \\
        --out docs/results/lm_eval.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from servelab.testing.server_process import ServerProcess

TASKS = Path(__file__).parent / "lm_eval_tasks"
MC_TASK, PPL_TASK = "servelab_python_next_line", "servelab_python_files"
TASK_YAML = {
    MC_TASK: """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
""",
    PPL_TASK: """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
}
DATA = {MC_TASK: TASKS / "python_next_line.jsonl", PPL_TASK: TASKS / "python_files.jsonl"}


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_tasks(folder: Path) -> None:
    """The task YAMLs, pointing at the data files by absolute path."""
    for name, template in TASK_YAML.items():
        (folder / f"{name}.yaml").write_text(template.format(name=name, data=DATA[name].resolve()))


def run_harness(args: argparse.Namespace, model_name: str, tokenizer: str, url: str, workdir: Path) -> dict:
    """Run lm_eval against the server; its ``results`` per task."""
    model_args = (f"model={model_name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tokenizer},max_length={args.max_length},num_concurrent={args.concurrency},"
                  f"max_retries=1")
    command = [args.lm_eval, "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", f"{MC_TASK},{PPL_TASK}", "--include_path", str(workdir), "--output_path",
               str(workdir / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env)
    (result_file,) = glob.glob(str(workdir / "out" / "**" / "results_*.json"), recursive=True)
    with open(result_file) as f:
        return json.load(f)["results"]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as the harness splits them (whole text encoded once)."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return whole[:len(context_ids)], whole[len(context_ids):]


def continuation_logprob(output, num_context: int) -> float:
    """Sum of the prompt logprobs of the tokens after the first ``num_context``."""
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    return sum(entries[i][ids[i]].logprob for i in range(num_context, len(ids)))


def score_offline(args: argparse.Namespace) -> dict:
    """The tasks' metrics from the offline engine's prompt logprobs."""
    from servelab import LLM, SamplingParams

    llm = LLM(args.model, overrides=args.overrides)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    items = read_jsonl(DATA[MC_TASK])
    prompts, spans = [], []
    for item in items:
        for choice in item["choices"]:
            context, continuation = encode_pair(tokenizer, item["context"], choice)
            prompts.append(context + continuation)
            spans.append(len(context))
    scores = [continuation_logprob(out, n) for out, n in zip(llm.generate(prompts, params, use_tqdm=False), spans)]
    correct = correct_norm = 0
    for k, item in enumerate(items):
        own = scores[4 * k:4 * k + 4]
        normed = [s / len(c.encode("utf-8")) for s, c in zip(own, item["choices"])]
        correct += own.index(max(own)) == item["answer"]
        correct_norm += normed.index(max(normed)) == item["answer"]
    docs = read_jsonl(DATA[PPL_TASK])
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    outputs = llm.generate([[prefix] + tokenizer.encode(d["text"], add_special_tokens=False) for d in docs],
                           params, use_tqdm=False)
    total = sum(continuation_logprob(out, 1) for out in outputs)
    words = sum(len(re.split(r"\s+", d["text"])) for d in docs)  # the harness's word count
    num_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
    return {MC_TASK: {"acc": correct / len(items), "acc_norm": correct_norm / len(items)},
            PPL_TASK: {"word_perplexity": math.exp(-total / words), "byte_perplexity": math.exp(-total / num_bytes),
                       "bits_per_byte": -total / num_bytes / math.log(2)}}


def served_model(args: argparse.Namespace) -> tuple[str, str]:
    """The served model name and the checkpoint folder (the harness's tokenizer)."""
    from servelab.core.config import resolved
    from servelab.server.config import compose_serve_config

    cfg = resolved(compose_serve_config([f"model={args.model}", *args.overrides]))
    return cfg.server.served_model_name or args.model, cfg.model.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command of lm-eval's virtual environment")
    parser.add_argument("--model", default="tiny", help="servelab model preset")
    parser.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides for server and engine")
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--max-length", type=int, default=512, help="the harness's context window (tokens)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", help="write the JSON of both results here")
    args = parser.parse_args()
    model_name, tokenizer = served_model(args)
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_tasks(workdir)
        server = ServerProcess.servelab(workdir / "server.log", f"model={args.model}", *args.overrides, port=args.port,
                                        startup_timeout_s=600)
        try:
            started = time.perf_counter()
            harness = run_harness(args, model_name, tokenizer, url, workdir)
            harness_s = time.perf_counter() - started
        finally:
            server.stop()
    offline = score_offline(args)
    rows = []
    for task, metrics in offline.items():
        for metric, value in metrics.items():
            served = harness[task][f"{metric},none"]
            rows.append({"task": task, "metric": metric, "lm_eval": served, "offline": value})
            print(f"{task:28s} {metric:16s} lm-eval {served:.6f}  offline {value:.6f}")
    print(f"lm-eval ran for {harness_s:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "overrides": args.overrides, "max_length": args.max_length,
                       "harness_seconds": round(harness_s, 1), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
