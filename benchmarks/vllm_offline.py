"""Runs vLLM's offline ``LLM.generate`` on a workload file and prints one JSON line.

Executed by ``compare_vllm.py`` with the Python of a separate environment where vLLM
is installed (servelab does not depend on vLLM):

    /path/to/vllm-venv/bin/python benchmarks/vllm_offline.py MODEL_DIR WORKLOAD.json DTYPE
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    """Load the model, warm up, time one generate call over every prompt."""
    from vllm import LLM, SamplingParams

    folder, workload_path, dtype = sys.argv[1:4]
    with open(workload_path) as f:
        workload = json.load(f)
    llm = LLM(model=folder, dtype=dtype, max_model_len=workload["max_model_len"], seed=0,
              max_num_seqs=workload["max_num_seqs"], enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=workload["output_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    first = [list(o.outputs[0].token_ids) for o in outputs[:8]]
    print(json.dumps({"engine": "vllm", "seconds": seconds, "output_tokens": tokens, "first_outputs": first}))


if __name__ == "__main__":
    main()
