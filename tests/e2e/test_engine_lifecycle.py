"""Engines released on demand: ten engines of alternating configurations in one process,
released by ``shutdown``, by ``with`` and by dropping the last reference, leave no
process, thread, process group or memory behind; interpreter exit stops the workers of
an engine nobody shut down; an engine used after ``shutdown`` says so."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from servelab import LLM, SamplingParams
from servelab.core.errors import EngineShutdownError
from servelab.testing import ProcessResources, assert_released
from servelab.testing.lifecycle import is_alive

CPU = ["device=cpu", "model.dtype=float32"]
ENGINES = [
    ("toy", []),
    ("toy", ["parallel.tensor_parallel_size=2"]),
    ("tiny", ["decoding=speculative"]),
    ("toy", ["parallel.pipeline_parallel_size=2", "scheduler=chunked", "scheduler.token_budget=16"]),
    ("toy", ["model.quantization=int8"]),
    ("toy", ["parallel.tensor_parallel_size=2", "decoding=ngram", "cache.enable_prefix_caching=true"]),
    ("toy", ["executor=simulated"]),
    ("toy", ["parallel.pipeline_parallel_size=2"]),
    ("tiny", ["decoding=speculative", "parallel.tensor_parallel_size=2"]),
    ("toy", ["scheduler=static", "cache=contiguous"]),
]
"""Every engine holds 512 MiB of zeroed KV cache on its first rank (the CPU default), so
one that leaked would show in resident memory."""
RSS_SLACK_BYTES = 160 << 20


def release(llm: LLM, how: int) -> None:
    """Release ``llm`` the ``how``-th way: ``shutdown``, ``with``'s exit, or ``del``."""
    if how == 0:
        llm.shutdown()
    elif how == 1:
        with llm:
            pass
    else:
        del llm
        gc.collect()


def test_ten_engines_in_a_row_leave_nothing_behind():
    first = ProcessResources.now()
    warm = None
    for index, (model, overrides) in enumerate(ENGINES):
        llm = LLM(model, overrides=[*CPU, *overrides])
        outputs = llm.generate(["def f(x):", "import"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4], (model, overrides)
        release(llm, index % 3)
        del llm
        if warm is None:  # torch's and the tokenizer's thread pools now exist
            warm = ProcessResources.now()
        after = assert_released(warm, RSS_SLACK_BYTES)
        assert after.children == first.children and after.python_threads == first.python_threads, (index, overrides)
        assert not after.process_group


def test_engines_that_nobody_shut_down_stop_their_workers_at_exit(tmp_path):
    script = tmp_path / "script.py"  # no __main__ guard: workers never re-import the main module
    script.write_text(textwrap.dedent("""
        from servelab import LLM, SamplingParams
        llm = LLM("toy", overrides=["device=cpu", "parallel.tensor_parallel_size=2"])
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        print(*(w.pid for w in llm.engine.executor.workers), flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (worker,) = map(int, done.stdout.split())
    assert not is_alive(worker)
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr


def test_an_engine_used_after_shutdown_names_the_call():
    llm = LLM("toy", overrides=CPU)
    engine = llm.engine
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
    engine.step()
    llm.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.cache.usage.used_blocks == 0 and engine.executor.kv_caches == []
    calls = {"generate": lambda: llm.generate(["hi"]), "add_request": lambda: engine.add_request([1, 2]),
             "step": engine.step, "warm_up": engine.warm_up, "abort_request": lambda: engine.abort_request(request)}
    for name, call in calls.items():
        with pytest.raises(EngineShutdownError, match=f"^{name}: this engine has been shut down"):
            call()
    llm.shutdown()
