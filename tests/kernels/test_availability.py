"""triton_unavailable_reason: None when the kernels can run, else an actionable message."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from servelab.kernels.availability import triton_unavailable_reason

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")


@needs_triton
def test_interpreter_is_enough(monkeypatch):
    """TRITON_INTERPRET=1 makes the kernels runnable without a GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert triton_unavailable_reason() is None


@needs_triton
def test_cuda_is_enough(monkeypatch):
    """A visible CUDA GPU makes the kernels runnable."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert triton_unavailable_reason() is None


@needs_triton
def test_cpu_without_interpreter_explains(monkeypatch):
    """No GPU and no interpreter: the message names the ways out."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = triton_unavailable_reason()
    assert reason is not None
    for hint in ("CUDA GPU", "TRITON_INTERPRET=1", "attention=sdpa", "attention=naive"):
        assert hint in reason


def test_missing_triton_explains(monkeypatch):
    """Without the triton package the message says so."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    reason = triton_unavailable_reason()
    assert reason is not None and "triton" in reason


def test_stale_native_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A lock left by a killed build would make every later process wait forever; one of a
    build still running stays."""
    import os
    import time

    from servelab.kernels.cpu_ops import STALE_LOCK_AGE_S, remove_stale_build_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not remove_stale_build_lock(str(tmp_path))
    assert lock.exists()
    old = time.time() - STALE_LOCK_AGE_S - 60
    os.utime(lock, (old, old))
    assert remove_stale_build_lock(str(tmp_path))
    assert not lock.exists()
    assert not remove_stale_build_lock(str(tmp_path))
