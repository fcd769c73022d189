"""Shared fixtures: tiny Hugging Face checkpoints written once per test session."""

from __future__ import annotations

import pytest

from servelab.testing import tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Folders of tiny random llama, llama3 (rope scaling), qwen2 and qwen3 checkpoints."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: tiny_checkpoint(root / family, family) for family in ("llama", "llama3", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="session")
def llama(checkpoints) -> str:
    """The tiny Llama folder."""
    return checkpoints["llama"]


@pytest.fixture
def attention_env(monkeypatch):
    """Prepare the environment an attention backend needs on this machine, or skip.

    ``flash`` runs its Triton kernels in the interpreter (TRITON_INTERPRET=1) on CPU.
    """
    def prepare(name: str) -> None:
        if name == "flash":
            pytest.importorskip("triton")
            monkeypatch.setenv("TRITON_INTERPRET", "1")
    return prepare
