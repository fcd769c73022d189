"""Offline throughput as ``LLM.generate`` measures it, the same procedure for every engine:
all requests submitted at once, a short untimed ``generate`` first, then one timed call.

The requests travel as a JSON *workload file* (``write_workload_file``) so that an engine
in another environment reads exactly the same ones: ``benchmarks/vllm_offline.py`` runs in
vLLM's virtual environment, where servelab is not installed, and loads this file by its
path. So this module imports only the standard library at the top; servelab is imported
inside the functions that need it.

Workload file: ``{"prompts": [[token ids], ...], "max_tokens": [per request],
"max_model_len": int, "max_num_seqs": int}``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

WARMUP_PROMPTS = 4
WARMUP_TOKENS = 4
FIRST_OUTPUTS = 8


def write_workload_file(path: str, requests: Sequence[Any], max_model_len: int, max_num_seqs: int) -> str:
    """Write ``requests`` (``servelab.bench.workload.BenchRequest``) as a workload file."""
    with open(path, "w") as f:
        json.dump({"prompts": [list(r.prompt_token_ids) for r in requests],
                   "max_tokens": [r.max_tokens for r in requests],
                   "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}, f)
    return path


def write_comparison_workload(path: str, num_requests: int = 256, output_tokens: int = 128) -> str:
    """The vLLM comparison's workload file: ``servelab-bench``'s ``offline`` preset
    (``num_requests`` at once, prompts of 16-256 random ids, seed 0) with ``output_tokens``
    per request, for ``servelab.bench.random_llama``'s models (vocabulary 2048, context 512)
    with every request running at once."""
    from servelab.bench.random_llama import MAX_POSITIONS, VOCAB, word_tokenizer
    from servelab.bench.workload import TokenSpace, build_workload, workload_preset

    cfg = workload_preset("offline", num_requests=num_requests, output_range=[output_tokens, output_tokens])
    requests = build_workload(cfg, TokenSpace(VOCAB, MAX_POSITIONS, word_tokenizer(VOCAB)))
    return write_workload_file(path, requests, max_model_len=MAX_POSITIONS, max_num_seqs=num_requests)


def read_workload_file(path: str) -> dict[str, Any]:
    """A workload file's contents."""
    with open(path) as f:
        return json.load(f)


def time_generate(generate: Callable[[list[list[int]], list[int]], list[Any]], token_ids: Callable[[Any], list[int]],
                  workload: dict[str, Any], engine: str,
                  timed: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> dict[str, Any]:
    """Warm up on the first prompts with a few tokens, then time one ``generate`` over all.

    ``generate(prompts, max_tokens)`` runs the engine (one output per prompt, in order);
    ``token_ids(output)`` reads an output's generated ids (after the clock stops);
    ``timed()`` is a context entered around the timed call only (a profiler, counters).
    Returns the engine's name, the seconds, the output tokens and the first outputs' ids
    (to compare engines' greedy outputs).
    """
    generate(workload["prompts"][:WARMUP_PROMPTS], [WARMUP_TOKENS] * min(WARMUP_PROMPTS, len(workload["prompts"])))
    with timed():
        started = time.perf_counter()
        outputs = generate(workload["prompts"], workload["max_tokens"])
        seconds = time.perf_counter() - started
    ids = [list(token_ids(o)) for o in outputs]
    return {"engine": engine, "seconds": seconds, "output_tokens": sum(len(i) for i in ids),
            "first_outputs": ids[:FIRST_OUTPUTS]}


def servelab_llm(folder: str, workload: dict[str, Any], dtype: str, overrides: Sequence[str]) -> Any:
    """servelab's ``LLM`` on the checkpoint ``folder`` sized for ``workload`` (context,
    concurrent sequences), its matmul kernels compiled for every step size (``warm_up``)."""
    from servelab import LLM

    llm = LLM(folder, overrides=[f"model.dtype={dtype}", f"model.max_model_len={workload['max_model_len']}",
                                 f"scheduler.max_num_seqs={workload['max_num_seqs']}", *overrides])
    llm.warm_up()
    return llm


def servelab_generate(llm: Any) -> Callable[[list[list[int]], list[int]], list[Any]]:
    """``generate(prompts, max_tokens)`` for ``time_generate``: greedy, ``ignore_eos``."""
    from servelab import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[Any]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return llm.generate(prompts, params, use_tqdm=False)

    return generate


def servelab_token_ids(output: Any) -> list[int]:
    """The generated ids of a servelab ``RequestOutput``."""
    return output.outputs[0].token_ids


def run_servelab(folder: str, workload_path: str, dtype: str, overrides: Sequence[str]) -> dict[str, Any]:
    """servelab's offline run over a workload file (``time_generate``'s result)."""
    workload = read_workload_file(workload_path)
    llm = servelab_llm(folder, workload, dtype, overrides)
    return time_generate(servelab_generate(llm), servelab_token_ids, workload, "servelab")
