"""Linear layers that multiply with a weight packed once (CPU).

``torch.nn.Linear`` reorders its weight for the matmul library on every call; on the CPU
that reorder dominates at decode batch sizes. ``Linear`` keeps a packed copy: float32
weights in servelab's blocked layout for ``float_linear`` (``servelab/kernels/blocked_linear.py``),
bfloat16 ones for oneDNN, whose input rows it pads to a few bucket sizes so oneDNN compiles
a bounded set of kernels, and a blocked bfloat16 copy for ``bf16_linear`` at decode row
counts; see docs/cpu_kernels.md.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from servelab.kernels.blocked_linear import pack_blocks
from servelab.kernels.cpu_ops import native_cpu_available, native_cpu_enabled

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BLOCKED_BFLOAT16_ROWS = 16
"""A bfloat16 ``Linear`` on the CPU multiplies at most this many rows with ``bf16_linear``
over a blocked copy of its weight (decode steps: the weight streams at memory speed with
no call overhead), more with oneDNN (prefill: its bfloat16 matmul instructions)."""


def blocked_rows(rows: int, dtype: torch.dtype) -> bool:
    """True where ``rows`` input rows of ``dtype`` multiply through a blocked kernel:
    float32 at any count, bfloat16 up to ``BLOCKED_BFLOAT16_ROWS``."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and rows <= BLOCKED_BFLOAT16_ROWS)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to one of a few bucket sizes: exact up to 16, then multiples of
    16, then of an eighth of the power of two below (at most 12.5% more rows).

    oneDNN compiles a kernel for every new row count it multiplies; a server's steps have
    a new count almost every step (4-10 ms of compilation per linear layer each time), so
    the packed path pads its input to these buckets and keeps a few hundred kernels."""
    if rows <= 16:
        return rows
    granule = max(16, 1 << (rows.bit_length() - 4))
    return -(-rows // granule) * granule


def warm_up_linears(module: nn.Module, max_rows: int) -> int:
    """Pack every CPU ``Linear`` of ``module`` and multiply once through each distinct
    oneDNN-packed shape at every row bucket up to ``max_rows`` that oneDNN multiplies
    (zeros in, nothing kept), so neither the packing nor oneDNN's kernel compilation
    happens during the first requests; returns the kernels warmed (none for float32 layers
    and bfloat16 decode rows: the blocked kernels compile nothing)."""
    buckets = sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})
    shapes = set()
    warmed = 0
    with torch.inference_mode():
        for layer in module.modules():
            if not isinstance(layer, Linear) or layer.weight.device.type != "cpu":
                continue
            shape = (layer.in_features, layer.out_features, layer.weight.dtype, layer.bias is not None)
            packed = layer._packed_weight(layer.weight)
            smallest = BLOCKED_BFLOAT16_ROWS + 1 if layer.blocked_bfloat16() is not None else 1
            if packed is None or is_blocked(packed) or shape in shapes:
                continue
            shapes.add(shape)
            for rows in buckets:
                if rows >= smallest:
                    layer(layer.weight.new_zeros(rows, layer.in_features))
                    warmed += 1
    return warmed


class BlockedCopy:
    """A CPU weight's copy in the blocked layout of ``float_linear`` and ``bf16_linear``
    (``pack_blocks``), packed on first use and again when the weight changes (its version,
    storage or dtype)."""

    def __init__(self) -> None:
        self.copy: tuple[tuple, torch.Tensor] | None = None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The blocked copy of ``weight`` [N, K]: [N' / 16, K, 16]."""
        key = (weight._version, weight.data_ptr(), weight.dtype)
        if self.copy is None or self.copy[0] != key:
            self.copy = None  # free the old copy before packing the new one
            with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
                self.copy = (key, pack_blocks(weight))
        return self.copy[1]


def blocked_weight_runs(weight: torch.Tensor) -> bool:
    """True where ``weight`` can multiply through a blocked kernel: float32 or bfloat16 on
    the CPU with the native ops built and on."""
    return (weight.dtype in PACKED_DTYPES and weight.device.type == "cpu" and native_cpu_enabled()
            and native_cpu_available())


def blocked_matmul(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """rows [M, K] (the packed weight's dtype) @ weight.T -> [M, out_features] through
    ``float_linear`` or ``bf16_linear`` on the weight's blocked copy ``packed``."""
    out = rows.new_empty(rows.shape[0], out_features)
    kernel = torch.ops.servelab_cpu.float_linear if packed.dtype == torch.float32 else torch.ops.servelab_cpu.bf16_linear
    kernel(out, rows.contiguous(), packed)
    return out


class Linear(nn.Linear):
    """``nn.Linear`` that, on the CPU, multiplies with a copy of its weight packed once:
    float32 weights in the blocked layout of servelab's ``float_linear`` (1.1-2.6x faster
    than oneDNN at 1-16 rows on the development VM, about as fast on prefill-sized
    inputs), bfloat16 ones for oneDNN (``torch.ops.mkldnn``). ``F.linear`` reorders the
    weight on every call, which dominates at decode batch sizes. The copy is rebuilt when
    the weight changes (its version counter) and costs one more weight's memory (two for
    bfloat16 weights packed in float32, see ``_pack``); ``SERVELAB_NATIVE_CPU=0`` turns it
    off with the other native CPU paths. A bfloat16 layer also keeps its weight in the
    blocked layout for inputs of at most ``BLOCKED_BFLOAT16_ROWS`` rows (``bf16_linear``:
    float32 sums rounded once to bfloat16, as oneDNN's), one more weight's memory."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed: tuple[tuple, torch.Tensor | None] | None = None
        self._blocked = BlockedCopy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]."""
        packed = self._packed_weight(x) if x.device.type == "cpu" else None
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        blocked = packed if is_blocked(packed) else (
            self.blocked_bfloat16() if blocked_rows(rows.shape[0], rows.dtype) else None)
        if blocked is not None:  # float_linear's op (any row count) or bf16_linear's, no padding
            out = blocked_matmul(rows, blocked, self.out_features)
            if self.bias is not None:
                out += self.bias
            return out.view(*x.shape[:-1], self.out_features)
        num_rows = rows.shape[0]
        padded = padded_rows(num_rows)
        bias = self.bias
        if packed.dtype != rows.dtype:  # bfloat16 where oneDNN has no bfloat16 matmul: see _pack
            rows = _padding_buffer(padded, rows, packed.dtype)
            bias = None if bias is None else bias.to(packed.dtype)
        elif padded != num_rows:
            extended = _rows_in_place(padded, rows)
            rows = extended if extended is not None else _padding_buffer(padded, rows, rows.dtype)
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")[:num_rows]
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight
        key = (weight._version, weight.data_ptr(), weight.dtype)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, _pack(weight))
        packed = self._packed[1]
        return packed if packed is not None and x.dtype == weight.dtype else None

    def blocked_bfloat16(self) -> torch.Tensor | None:
        """The bfloat16 weight in ``bf16_linear``'s blocked layout (packed on first use,
        rebuilt when the weight changes), or None for other dtypes, off the CPU or without
        the native ops."""
        weight = self.weight
        if weight.dtype != torch.bfloat16 or not blocked_weight_runs(weight):
            return None
        return self._blocked.of(weight)


def linear_input(rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized [rows, columns] tensor for an op's output that a ``Linear`` reads
    next: it is the head of a tensor with the padded row count, whose extra rows are
    zeros, so the matmul needs no copy."""
    padded = like.new_empty(padded_rows(rows), columns)
    if padded.shape[0] > rows:  # most decode steps fill their bucket exactly
        padded[rows:].zero_()
    return padded[:rows]


def _rows_in_place(num_rows: int, rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` extended to ``num_rows`` rows over its own memory when it is the head of a
    tensor allocated with exactly that many rows (a packed matmul's output sliced to its
    real rows, or ``linear_input``), else None. The extra rows hold zeros or the products
    of earlier padding rows, never uninitialized memory (whose denormal bit patterns make
    float32 multiplies 30x slower); the caller drops their products."""
    columns = rows.shape[1]
    if not rows.is_contiguous() or rows.storage_offset() != 0:
        return None
    if rows.untyped_storage().nbytes() != num_rows * columns * rows.element_size():
        return None
    return rows.as_strided((num_rows, columns), (columns, 1))


_padding = threading.local()


def _padding_buffer(num_rows: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` copied (converted to ``dtype``) into the first rows of a reused [num_rows, K]
    buffer of this thread.

    The rows past them hold whatever an earlier call left: every output row of a matmul
    depends on its own input row alone, and the caller drops those rows, so they need no
    zeros. Reusing the buffer saves allocating, page-faulting and zero-filling a fresh
    tensor (megabytes in a prefill step) for each linear layer."""
    key = (rows.shape[1], dtype)
    buffers = _padding.__dict__.setdefault("buffers", {})
    buffer = buffers.get(key)
    if buffer is None or buffer.shape[0] < num_rows:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buffer = buffers[key] = rows.new_zeros(num_rows, rows.shape[1], dtype=dtype)
    buffer[:rows.shape[0]].copy_(rows)
    return buffer[:num_rows]


def release_padding_buffers() -> int:
    """Drop this thread's padding buffers (an engine that shuts down returns their
    memory; the next matmul that pads makes new ones); returns the bytes released."""
    buffers = _padding.__dict__.pop("buffers", {})
    return sum(buffer.untyped_storage().nbytes() for buffer in buffers.values())


def bfloat16_matmul_supported() -> bool:
    """True when oneDNN multiplies bfloat16 natively on this CPU (AVX-512 BF16 or AMX)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pads_rows(dtype: torch.dtype) -> bool:
    """True when CPU ``Linear`` layers of this dtype pad their rows to ``padded_rows``
    buckets (the oneDNN path); float32 layers in the blocked layout multiply any row count."""
    if not native_cpu_enabled() or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return not (dtype == torch.float32 and native_cpu_available())


def is_blocked(packed: torch.Tensor) -> bool:
    """True for a float32 weight in ``float_linear``'s blocked layout ([N / 16, K, 16]),
    False for a oneDNN-packed one (2-D)."""
    return packed.dim() == 3


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a CPU weight, or None where no packed path is available: float32
    in the blocked layout where the native CPU ops are built, else packed for oneDNN.

    A bfloat16 weight on a CPU without bfloat16 matmul instructions (AVX2, AVX-512 without
    BF16) is packed in float32: there torch's bfloat16 matmul is emulated and runs 4-7x
    slower than float32. ``Linear`` then converts its input to float32 and rounds the
    output back to bfloat16, which gives what a bfloat16 kernel gives (products of bfloat16
    values are exact in float32, sums accumulate in float32) at twice the weight memory."""
    if not native_cpu_enabled():
        return None
    if weight.dtype == torch.float32 and native_cpu_available():
        with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
            return pack_blocks(weight)
    if weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not bfloat16_matmul_supported():
        weight = weight.float()
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    except (RuntimeError, AttributeError):  # a torch build without the op
        return None
