"""vLLM's offline ``LLM.generate`` over a workload file; prints one JSON line.

Executed by ``compare_vllm.py`` with the Python of a separate environment where vLLM
is installed (servelab does not depend on vLLM, and is not installed there):

    /path/to/vllm-venv/bin/python benchmarks/vllm_offline.py MODEL_DIR WORKLOAD.json DTYPE

The procedure is servelab's, from the same file: ``bench/offline_run.py`` (warm-up, one
timed ``generate``), loaded by its path because it imports nothing of servelab at the top.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

OFFLINE_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench", "offline_run.py")


def load_offline_run():
    """``bench/offline_run.py`` of this checkout, as a module."""
    spec = importlib.util.spec_from_file_location("offline_run", OFFLINE_RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Load the model, then ``time_generate`` over every prompt (greedy, ``ignore_eos``)."""
    if len(sys.argv) != 4 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    offline_run = load_offline_run()
    from vllm import LLM, SamplingParams

    folder, workload_path, dtype = sys.argv[1:4]
    workload = offline_run.read_workload_file(workload_path)
    llm = LLM(model=folder, dtype=dtype, max_model_len=workload["max_model_len"], seed=0,
              max_num_seqs=workload["max_num_seqs"], enable_prefix_caching=False)

    def generate(prompts, max_tokens):
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)

    print(json.dumps(offline_run.time_generate(generate, lambda o: o.outputs[0].token_ids, workload, "vllm")))


if __name__ == "__main__":
    main()
