"""The README's two set-up commands are the ones CI runs."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = 'pip install -e ".[test]" && servelab "prompt=\'def fibonacci(n):\'"'
    assert install in readme and install in ci
    assert "\npytest\n" in readme and "\npytest\n" in ci
