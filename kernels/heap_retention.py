"""Keep freed heap memory in the process, so a step's activations reuse warm pages.

Each step allocates and frees activations of a few hundred KiB to tens of MiB. glibc
serves blocks above its mmap threshold with fresh ``mmap`` mappings and returns freed
memory at the top of the heap to the OS above its trim threshold; either way the next
step's tensors start on pages the kernel must fault in and zero again (about 10^5 page
faults and half a second of system time per 256-request offline run of the 26m model).
Raising both thresholds keeps that memory mapped: the process holds on to its peak heap
size (plus up to 256 MiB free at the top of the heap), which a serving engine reaches again
every step anyway. Blocks above 32 MiB (glibc's ceiling for the threshold) stay mappings.
An engine that shuts down gives the retained memory back (``return_freed_heap_memory``).
"""

from __future__ import annotations

import ctypes
import functools

from servelab.kernels.libc import linux_libc

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit systems; larger blocks are still mapped.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20


@functools.lru_cache(maxsize=None)
def retain_freed_heap_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True when applied,
    False where there is no glibc ``mallopt`` (other OSes and C libraries)."""
    libc = linux_libc()
    mallopt = getattr(libc, "mallopt", None)  # musl and other C libraries have none
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def return_freed_heap_memory() -> bool:
    """Give the heap's free memory back to the OS (glibc's ``malloc_trim``), as an engine
    that shuts down does; True when some was returned, False without glibc."""
    trim = getattr(linux_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return bool(trim(0))
