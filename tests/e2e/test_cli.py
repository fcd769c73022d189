"""The ``servelab`` command: completions, help and errors as a user sees them."""

from __future__ import annotations

import subprocess
import sys

SERVELAB = [sys.executable, "-c", "from servelab.core.entrypoints.cli import main; main()"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVELAB, *args], capture_output=True, text=True, timeout=300)


def test_cli_prints_completion_and_summary():
    result = run("model=toy", "prompt='def f(x):'", "sampling.max_tokens=5", "use_tqdm=false")
    assert result.returncode == 0, result.stderr
    assert "=== prompt: 'def f(x):' (finish: length)" in result.stdout
    assert "1 prompts, 5 tokens in" in result.stdout and "tok/s" in result.stdout


def test_cli_help_lists_groups_and_options():
    result = run("--help")
    assert result.returncode == 0
    for line in ("attention: ", "cache: contiguous, paged", "scheduler: ", "decoding: ", "model: "):
        assert line in result.stdout
    assert "static" in result.stdout and "sdpa" in result.stdout


def test_cli_config_error_names_the_problem():
    result = run("model=toy", "scheduler.max_num_batched_tokens=10")
    assert result.returncode == 2
    assert "scheduler.max_num_batched_tokens=10 is below model.max_model_len=512" in result.stderr
