"""What servelab asks of the host: calls into its C library (Linux) that torch does not
expose, and a free TCP port.

- ``die_with_parent``: an engine or worker process never outlives the process that
  started it.
- ``huge_page_zeros``: CPU tensors backed by transparent huge pages, for the big buffers
  every step walks. The KV cache is read block by block in a scattered order; with 4 KiB
  pages each block is a page of its own and a decode step touches more pages than the TLB
  maps, so most block reads start with a page walk (expensive under virtualization).
  Memory advised with ``madvise(MADV_HUGEPAGE)`` before its first touch is backed by 2 MiB
  pages where the kernel allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` =
  ``always`` or ``madvise``). Elsewhere (other OSes, THP off) these are ordinary tensors.
- ``retain_freed_heap_memory`` / ``return_freed_heap_memory``: keep freed heap memory in
  the process, so a step's activations reuse warm pages. Each step allocates and frees
  activations of a few hundred KiB to tens of MiB. glibc serves blocks above its mmap
  threshold with fresh ``mmap`` mappings and returns freed memory at the top of the heap to
  the OS above its trim threshold; either way the next step's tensors start on pages the
  kernel must fault in and zero again (about 10^5 page faults and half a second of system
  time per 256-request offline run of the 26m model). Raising both thresholds keeps that
  memory mapped: the process holds on to its peak heap size (plus up to 256 MiB free at the
  top of the heap), which a serving engine reaches again every step anyway. An engine that
  shuts down gives the retained memory back.
- ``mmap_max_setter``: while a CPU engine's step runs, blocks above 32 MiB
  (glibc's ceiling for the mmap threshold) come from the heap too. A 2048-token step of the
  0.5B shape makes 40-80 MiB activations (the gate/up projection's output, the SiLU
  product), which as mappings were faulted in and zeroed at every step. Outside steps
  glibc maps them as before, so the engine's long-lived buffers (weights, KV cache) stay
  mappings that are unmapped when freed, however the engine is released (except a weight
  packed on first use inside a step, when the engine was not warmed up: freed, it stays in
  the heap until the next trim, as smaller blocks do).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import signal
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

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


HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's ``madvise``, or None where there is none (not Linux)."""
    libc = linux_libc()
    if libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)``; on Linux CPU tensors of at least 2 MiB, its
    memory starts on a 2 MiB boundary and is advised for huge pages before it is zeroed
    (the first touch, which is when the kernel picks the page size)."""
    import torch  # here: the server process imports this module without torch

    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if device.type != "cpu" or madvise is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[offset:offset + nbytes]
    madvise(region.data_ptr(), nbytes, MADV_HUGEPAGE)  # advice only: failure leaves 4 KiB pages
    return region.zero_().view(dtype).view(shape)


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
# glibc's ceiling for the mmap threshold on 64-bit systems; larger blocks are mapped (outside steps).
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
DEFAULT_MMAP_MAX = 65536
"""glibc's default for ``M_MMAP_MAX``, the number of blocks it may serve as mappings at once."""


@functools.lru_cache(maxsize=None)
def _mallopt():
    """glibc's ``mallopt``, or None where there is none (other OSes, musl and other C
    libraries)."""
    mallopt = getattr(linux_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        mallopt.restype = ctypes.c_int
    return mallopt


@functools.lru_cache(maxsize=None)
def retain_freed_heap_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True when applied,
    False where there is no glibc ``mallopt``."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def mmap_max_setter() -> Callable[[int], int] | None:
    """``set(n)`` sets glibc's ``M_MMAP_MAX`` for this process, the number of blocks it may
    serve as mappings at once: 0 serves blocks of every size from the heap,
    ``DEFAULT_MMAP_MAX`` is glibc's default. A C call (no Python frame runs in it, so a
    step may make two); None without glibc ``mallopt``."""
    mallopt = _mallopt()
    return None if mallopt is None else functools.partial(mallopt, M_MMAP_MAX)


def return_freed_heap_memory() -> bool:
    """Give the heap's free memory back to the OS (glibc's ``malloc_trim``), as an engine
    that shuts down does; True when some was returned, False without glibc."""
    trim = getattr(linux_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return bool(trim(0))


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now (a server's or a process
    group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
