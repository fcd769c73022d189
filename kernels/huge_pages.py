"""CPU tensors backed by transparent huge pages, for the big buffers every step walks.

The KV cache is read block by block in a scattered order; with 4 KiB pages each block is
a page of its own and a decode step touches more pages than the TLB maps, so most block
reads start with a page walk (expensive under virtualization). Memory advised with
``madvise(MADV_HUGEPAGE)`` before its first touch is backed by 2 MiB pages where the
kernel allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or
``madvise``). Elsewhere (other OSes, THP off) these are ordinary tensors.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from servelab.kernels.libc import linux_libc

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
