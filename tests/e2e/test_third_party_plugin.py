"""examples/third_party_plugin is a separate pip package found through its entry point."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

PLUGIN = pathlib.Path(__file__).resolve().parents[2] / "examples" / "third_party_plugin"


@pytest.fixture(scope="module")
def installed_plugin() -> None:
    """Install the example package (editable, so this checkout's copy is the one loaded)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                    str(PLUGIN)], check=True, timeout=600)
    assert importlib.metadata.distribution("servelab-spf") is not None


def test_plugin_scheduler_runs_end_to_end(installed_plugin):
    """The plugin's own tests (servelab's conformance check + its policy) pass in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PLUGIN / "tests")],
                            capture_output=True, text=True, timeout=600, cwd=PLUGIN)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plugin_option_is_listed_by_help(installed_plugin):
    result = subprocess.run([sys.executable, "-c", "from servelab.core.entrypoints.cli import main; main()", "--help"],
                            capture_output=True, text=True, timeout=300)
    assert "shortest_prompt_first" in result.stdout
