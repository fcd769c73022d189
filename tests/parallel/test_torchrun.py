"""Ranks started by ``torchrun`` (``-m servelab.launch``), as on several nodes: the console
script on rank 0 drives the workers and prints what one process prints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelab import ConfigError, LLM, SamplingParams
from servelab.testing import tiny_checkpoint

PROMPT = "def add(a, b):"


def printed_completion(stdout: str) -> str:
    """What ``servelab`` printed for its one prompt (between the ``===`` and ``---`` lines)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("=== prompt:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("--- ") and i > start)
    return "\n".join(lines[start + 1:end])


def test_torchrun_ranks_print_what_one_process_prints(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    args = [f"model.path={folder}", "model=local", "model.dtype=float32", f"prompt='{PROMPT}'",
            "sampling.temperature=0", "sampling.repetition_penalty=1", "sampling.max_tokens=12", "use_tqdm=false"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                             "--nproc-per-node=2", "-m", "servelab.launch", "servelab", *args,
                             "parallel.tensor_parallel_size=2"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    llm = LLM(folder, overrides=["model.dtype=float32"])
    (expected,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert printed_completion(result.stdout) == PROMPT + expected.outputs[0].text


def test_env_init_without_torchrun_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ConfigError, match="parallel.init_method=env needs the torchrun environment"):
        LLM(folder, overrides=["parallel.tensor_parallel_size=2", "parallel.init_method=env"])


def test_launch_refuses_an_unknown_script():
    result = subprocess.run([sys.executable, "-m", "servelab.launch", "pip"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "servelab | servelab-serve | servelab-bench" in result.stderr
