"""Builds and loads the native CPU ops of ``csrc/`` (``torch.ops.servelab_cpu``).

The C++ sources (one file per op or group of ops, shared helpers in headers, one
registration: ``csrc/ops.h`` lists them) are compiled on first use into one library with the
host's compiler for the host's CPU (``-O3 -march=native``, with torch's ``CPU_CAPABILITY``
so ``at::vec`` uses AVX-512 or AVX2 where torch does) and cached by torch in
``TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``), so only the first
process on a machine pays the build (about a minute of compiler time, the sources in
parallel). ``SERVELAB_NATIVE_CPU=0`` turns the ops off (the torch implementations run instead).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [os.path.join(SOURCE_DIR, name) for name in (
    "register_ops.cpp", "paged_attention.cpp", "write_kv_cache.cpp", "prefill_attention.cpp",
    "rms_norm.cpp", "rotary_embedding.cpp", "silu_and_mul.cpp", "argmax_rows.cpp", "sample_rows.cpp",
    "blocked_linear.cpp", "w8a8_linear.cpp", "int4_linear.cpp", "w4a8_linear.cpp", "softmax_topk.cpp",
    "decode_layers.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_VARIABLE = "SERVELAB_NATIVE_CPU"
STALE_LOCK_AGE_S = 600.0


def capability_flags() -> list[str]:
    """Defines that select torch's SIMD implementation of ``at::vec`` for this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mprefer-vector-width=512"]
    if capability == "AVX2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


def native_cpu_enabled() -> bool:
    """False when ``SERVELAB_NATIVE_CPU=0`` turns servelab's CPU-specific fast paths off."""
    return os.environ.get(DISABLE_VARIABLE, "1") != "0"


def remove_stale_build_lock(build_directory: str, max_age_s: float = STALE_LOCK_AGE_S) -> bool:
    """Delete the build directory's ``lock`` file when it is older than ``max_age_s``; True
    when one was removed. A build killed halfway leaves that file behind, and every later
    process would wait on it forever; a live build (about a minute) never gets that old."""
    lock = os.path.join(build_directory, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return False
    if age < max_age_s:
        return False
    logger.warning("removing a stale native CPU ops build lock (%.0f s old): %s", age, lock)
    try:
        os.remove(lock)
    except FileNotFoundError:  # another process removed it first
        return False
    return True


@functools.lru_cache(maxsize=None)
def native_cpu_unavailable_reason() -> str | None:
    """Why the native CPU ops cannot be used here (None when they are built and loaded)."""
    if not native_cpu_enabled():
        return f"{DISABLE_VARIABLE}=0"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        remove_stale_build_lock(_get_build_directory("servelab_cpu_ops", False))
        load(name="servelab_cpu_ops", sources=SOURCES, extra_cflags=FLAGS + capability_flags(),
             extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as error:  # a failed build leaves servelab working on the torch ops
        logger.warning("native CPU ops unavailable, using torch ops: %s", error)
        return f"building the native CPU ops (servelab/kernels/csrc) failed: {error}"
    return None


@functools.lru_cache(maxsize=None)
def native_cpu_available() -> bool:
    """True when ``torch.ops.servelab_cpu`` is loaded (building it on first call)."""
    return native_cpu_unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def native_cpu_ops():
    """The ``torch.ops.servelab_cpu`` namespace; raises RuntimeError naming the reason when unavailable."""
    reason = native_cpu_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"native CPU ops are unavailable: {reason}")
    return torch.ops.servelab_cpu
