"""Shared setup for the Triton kernel tests.

TRITON_INTERPRET=1 is set here, before any test module imports triton, so the
kernels run on CPU tensors in Triton's interpreter.  Run with
``TRITON_INTERPRET=0`` on a CUDA machine to test the compiled kernels instead.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (atol, rtol) of kernel vs float32 reference, per dtype.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2e-2),
}


@pytest.fixture
def device() -> torch.device:
    """Where kernel tensors live: CPU under the interpreter, else CUDA (skip if absent)."""
    if not HAS_TRITON:
        pytest.skip("triton is not importable")
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is not 1 and no CUDA GPU is available")
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def build_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    spare_blocks: int = 3,
) -> dict:
    """Random flat batch over a shuffled paged KV cache.

    ``block_size=None`` builds the contiguous layout: one block of
    ``max(seq_lens)`` rounded up to 16 (plus 16) tokens per request.  Cache slots
    that no request owns are NaN, so any read past a context shows up in the output.
    Returns the kernel arguments as a dict (q, kv_cache, query_start_loc,
    seq_lens, block_table, scale, max_query_len).
    """
    if block_size is None:
        block_size = (max(seq_lens) + 15) // 16 * 16 + 16
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    next_block = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_req)):
        ids = perm[next_block:next_block + n]
        next_block += n
        table[r, :n] = torch.tensor(ids, dtype=torch.int32)
        table[r, n:] = perm[-1]  # unused entries point at a NaN block
        flat = torch.randn(2, n * block_size, num_kv_heads, head_dim)
        flat[:, seq_len:] = float("nan")
        kv[:, ids] = flat.view(2, n, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q_len, seq_len in zip(query_lens, seq_lens):
        assert q_len <= seq_len
        starts.append(starts[-1] + q_len)
    return dict(
        q=torch.randn(starts[-1], num_heads, head_dim).to(dtype).to(device),
        kv_cache=kv.to(dtype).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        scale=head_dim ** -0.5,
        max_query_len=max(query_lens),
    )


def drop_before_window(batch: dict, window: int) -> None:
    """Make ``batch`` what a windowed cache holds: the table entries of blocks wholly before
    each request's first query's window point at a NaN placeholder block, and the
    positions before it in the window's first block are NaN, so any read of them shows."""
    kv, table = batch["kv_cache"], batch["block_table"]
    block_size = kv.shape[2]
    placeholder = int(table[0, -1])  # the table's last column is unused: a spare NaN block
    query_lens = batch["query_start_loc"].diff().tolist()
    for r, (seq_len, q_len) in enumerate(zip(batch["seq_lens"].tolist(), query_lens)):
        start = max(seq_len - q_len - window + 1, 0)
        table[r, :start // block_size] = placeholder
        kv[:, int(table[r, start // block_size]), :start % block_size] = float("nan")


@pytest.fixture
def paged_batch():
    """The ``build_paged_batch`` factory, as a fixture."""
    return build_paged_batch


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Compare a kernel output to the reference with the dtype's tolerance."""
    atol, rtol = TOLERANCES[expected.dtype]
    assert not torch.isnan(actual).any(), "kernel output has NaN (read outside the context?)"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.fixture
def windowed():
    """The ``drop_before_window`` helper, as a fixture."""
    return drop_before_window


@pytest.fixture
def close():
    """The ``assert_close`` helper, as a fixture."""
    return assert_close


@pytest.fixture
def torch_threads():
    """``torch_threads(n)`` sets torch's intra-op thread count for the test; the previous
    count comes back after it."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)
