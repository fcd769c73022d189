"""Conformance kit for every way users run a component: the ``LLM`` API and the
``servelab``, ``servelab-serve`` and ``servelab-bench`` console scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from servelab.testing.engine_kit import EngineKit
from servelab.testing.kit import BUILTIN_OVERRIDES
from servelab.testing.server_process import ServerProcess

ENTRY_POINTS = ("llm", "servelab", "servelab-serve", "servelab-bench")
STARTUP_TIMEOUT_S = 180


def console_script(name: str) -> str:
    """The console script ``name`` installed beside this interpreter."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.skip(f"the {name} console script is not installed beside {sys.executable}")
    return str(path)


class EntryPointConformance(EngineKit):
    """A component through the offline API and the three console scripts, on a tiny
    checkpoint: ``LLM.generate``; ``servelab`` prints a completion; ``servelab-serve``
    starts, streams one completion and drains on SIGTERM with exit status 0;
    ``servelab-bench`` measures a small workload with no failed request.

    ``names`` are ``"<kind>=<name>"`` choices (None: every component of every config
    group in the registry); ``entry_points`` narrows which of ``ENTRY_POINTS`` run."""

    entry_points: ClassVar[tuple[str, ...]] = ENTRY_POINTS
    engine_base: ClassVar[tuple[str, ...]] = ("model.dtype=float32", "device=cpu")
    """The model's own context length, as users run it (warm-up covers every step size)."""

    @classmethod
    def component_names(cls) -> tuple[str, ...]:
        """``kind=name`` for every component checked."""
        if cls.names is not None:
            return tuple(cls.names)
        from servelab.core.engine.registry import CONFIG_GROUPS, get_registry

        registry = get_registry()
        return tuple(f"{kind}={name}" for kind in CONFIG_GROUPS for name in sorted(registry.specs(kind)))

    def component_overrides(self, name: str, checkpoint: str = "", draft: str = "") -> list[str]:
        """The choice ``kind=name`` and the settings that component needs."""
        kind, _, component = name.partition("=")
        needed = self.overrides.get(name, BUILTIN_OVERRIDES.get((kind, component), ()))
        return [name, *(o.format(checkpoint=checkpoint, draft=draft) for o in needed)]

    def pytest_generate_tests(self, metafunc) -> None:
        """Parametrize over components and entry points."""
        super().pytest_generate_tests(metafunc)
        if "entry_point" in metafunc.fixturenames:
            metafunc.parametrize("entry_point", self.entry_points)

    def test_runs_through(self, component, entry_point, kit_checkpoint, kit_draft, tmp_path):
        overrides = ["model=local", f"model.path={kit_checkpoint}",
                     *self.overrides_for(component, kit_checkpoint, kit_draft)]
        getattr(self, "run_" + entry_point.replace("servelab-", "").replace("servelab", "cli"))(overrides, tmp_path)

    def run_llm(self, overrides: list[str], tmp_path: Path) -> None:
        """``LLM.generate`` completes a prompt and leaves no block held."""
        from servelab import LLM, SamplingParams
        from servelab.testing.oracle import assert_no_leaked_blocks

        llm = LLM(overrides=overrides)
        (output,) = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 4
        assert_no_leaked_blocks(llm)

    def run_cli(self, overrides: list[str], tmp_path: Path) -> None:
        """``servelab`` prints the completion and its summary."""
        result = subprocess.run([console_script("servelab"), *overrides, "prompt='def f(x):'", "sampling.max_tokens=4",
                                 "use_tqdm=false"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "=== prompt: 'def f(x):'" in result.stdout and "1 prompts" in result.stdout

    def run_serve(self, overrides: list[str], tmp_path: Path) -> None:
        """``servelab-serve`` starts, streams a completion, and drains on SIGTERM."""
        import httpx

        server = ServerProcess.servelab(tmp_path / "serve.log", *overrides, command=(console_script("servelab-serve"),),
                                        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=STARTUP_TIMEOUT_S)
        try:
            body = {"prompt": "def f(x):", "max_tokens": 4, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
                assert response.status_code == 200
                chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
            assert finishes == ["length"] and chunks[-1]["usage"]["completion_tokens"] == 4, chunks
        finally:
            status = server.stop()
        assert status == 0, server.log()[-3000:]

    def run_bench(self, overrides: list[str], tmp_path: Path) -> None:
        """``servelab-bench`` serves a small workload with no failure."""
        result = subprocess.run([console_script("servelab-bench"), *overrides, "workload.num_requests=6",
                                 "warmup_requests=0", "use_tqdm=false"], capture_output=True, text=True, timeout=600,
                                cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        (path,) = tmp_path.glob("outputs/bench/*/*/metrics.json")
        metrics = json.loads(path.read_text())
        assert (metrics["num_completed"], metrics["num_failed"]) == (6, 0)

