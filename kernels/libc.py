"""The C library of this process, for the few memory calls torch does not expose."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import signal
import sys

PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=None)
def linux_libc() -> ctypes.CDLL | None:
    """libc on Linux (with ``errno`` kept for callers), None on other systems or when it
    cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process ``sig`` when its parent exits (however it exits), so
    that an engine or worker process never outlives the process that started it. A no-op
    elsewhere."""
    libc = linux_libc()
    if libc is not None:
        libc.prctl(PR_SET_PDEATHSIG, sig)
