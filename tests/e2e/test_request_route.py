"""One request's route stays short: ``benchmarks/request_route.py`` counts the servelab
files a request enters after a warm-up (docs/architecture.md lists them), offline on
``LLM("toy")`` and for a streamed completion over HTTP."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "request_route.py"
OFFLINE_TARGET = 22
HTTP_TARGET = 31


def route(kind: str) -> str:
    """The script's report of one route."""
    done = subprocess.run([sys.executable, str(SCRIPT), kind], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_offline_generate_enters_at_most_22_files():
    report = route("offline")
    count = int(re.search(r"LLM\.generate: (\d+) files", report).group(1))
    assert count <= OFFLINE_TARGET, report
    assert "core/engine/llm_engine.py" in report and "plugins/models/llama.py" in report


def test_streamed_http_completion_enters_at_most_31_files():
    report = route("http")
    count = int(re.search(r"(\d+) distinct files across both processes", report).group(1))
    assert count <= HTTP_TARGET, report
    assert "server process:" in report and "engine process:" in report
    assert "plugins/decoding/structured_output.py" not in report, "a request without a grammar reached grammar code"
