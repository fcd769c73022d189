"""Shared fixtures: tiny Hugging Face checkpoints written once per test session."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the interpreter on CPU

from servelab.core.hookspecs import hookimpl
from servelab.testing import tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Folders of tiny random llama, llama3 (rope scaling), qwen2, qwen3 and mistral checkpoints."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: tiny_checkpoint(root / family, family) for family in ("llama", "llama3", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="session")
def llama(checkpoints) -> str:
    """The tiny Llama folder."""
    return checkpoints["llama"]


@pytest.fixture
def attention_env():
    """``attention_env(name)`` skips when the backend cannot run here (``flash`` without triton)."""
    def prepare(name: str) -> None:
        if name == "flash":
            pytest.importorskip("triton")
    return prepare


class StepRecorder:
    """Records every ``SchedulerOutput`` and ``StepStats`` an engine produces."""

    def __init__(self, engine):
        self.outputs = []
        self.stats = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            output = schedule()
            self.outputs.append(output)
            return output

        engine.scheduler.schedule = recording_schedule
        engine.registry.plugin_manager.register(self)
        self._engine = engine

    @hookimpl
    def servelab_step_end(self, engine, stats):
        """Observer hook."""
        if engine is self._engine:
            self.stats.append(stats)

    def close(self) -> None:
        """Stop observing."""
        self._engine.registry.plugin_manager.unregister(self)


@pytest.fixture
def step_recorder():
    """``step_recorder(engine)`` starts recording that engine's steps."""
    recorders = []

    def attach(engine):
        recorder = StepRecorder(engine)
        recorders.append(recorder)
        return recorder
    yield attach
    for recorder in recorders:
        recorder.close()
