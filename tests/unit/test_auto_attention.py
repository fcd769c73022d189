"""attention=auto picks the native CPU backend where it can run, and sdpa otherwise."""

from __future__ import annotations

import pytest

from servelab import LLM
from servelab.core.engine.registry import get_registry
from servelab.kernels.cpu_ops import native_cpu_unavailable_reason
from servelab.plugins.attention import cpu

REGISTRY = get_registry()


def chosen_backend(llm: LLM) -> str:
    """The registered name of the attention backend the engine built."""
    return REGISTRY.spec_for_config("attention", llm.engine.cfg.attention).name


@pytest.mark.skipif(native_cpu_unavailable_reason() is not None, reason="native CPU ops unavailable")
def test_auto_is_the_default_and_picks_cpu_on_cpu():
    llm = LLM("toy", overrides=["device=cpu", "cache.memory_bytes=2000000"])
    assert chosen_backend(llm) == "cpu"
    assert type(llm.engine.executor.attention).__name__ == "CpuAttention"


def test_auto_falls_back_to_sdpa_without_the_native_ops(monkeypatch):
    monkeypatch.setattr(cpu, "native_cpu_unavailable_reason", lambda: "no C++ compiler")
    llm = LLM("toy", overrides=["device=cpu", "cache.memory_bytes=2000000"], attention="auto")
    assert chosen_backend(llm) == "sdpa"
    assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids) >= 1


def test_explicit_cpu_without_the_native_ops_names_the_reason(monkeypatch):
    from servelab import ConfigError

    monkeypatch.setattr(cpu, "native_cpu_unavailable_reason", lambda: "no C++ compiler")
    with pytest.raises(ConfigError, match=r"attention=cpu needs the native CPU ops: no C\+\+ compiler"):
        LLM("toy", overrides=["device=cpu", "cache.memory_bytes=2000000"], attention="cpu")
