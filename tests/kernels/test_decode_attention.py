"""paged_decode_attention (flash-decoding, Triton) vs the varlen reference with query_len 1."""

from __future__ import annotations

import itertools

import pytest
import torch

SEQ_LENS = [1, 37, 100, 16, 63]
BLOCK_SIZES = [1, 16, 32, None]  # None: contiguous layout, one big block per request
SPLITS = [None, 1, 3, 8]         # None: heuristic
GQA = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]

CASES = [
    pytest.param(bs, ns, GQA[i % 3], DTYPES[i % 2],
                 id=f"bs{bs or 'contig'}-splits{ns}-gqa{GQA[i % 3]}-{str(DTYPES[i % 2])[6:]}")
    for i, (bs, ns) in enumerate(itertools.product(BLOCK_SIZES, SPLITS))
]


@pytest.fixture
def decode():
    """The kernel module (imported lazily: skipped when triton is missing)."""
    return pytest.importorskip("servelab.kernels.decode_attention")


def decode_args(batch: dict) -> dict:
    """Decode-call arguments from a varlen batch whose query lengths are all 1."""
    return {k: batch[k] for k in ("q", "kv_cache", "seq_lens", "block_table", "scale")}


@pytest.mark.parametrize("block_size, num_splits, gqa, dtype", CASES)
def test_matches_reference(decode, paged_batch, close, device, block_size, num_splits, gqa, dtype):
    """Block sizes (shuffled tables) x split counts, GQA 1/2/4, fp32 and bf16."""
    batch = paged_batch(SEQ_LENS, [1] * len(SEQ_LENS), 4, 4 // gqa, 32, block_size, dtype, device)
    args = decode_args(batch)
    out = decode.paged_decode_attention(**args, max_seq_len=max(SEQ_LENS), num_splits=num_splits)
    close(out, decode.paged_decode_attention_reference(**args))


@pytest.mark.parametrize("window", [1, 7, 33, 200])
@pytest.mark.parametrize("block_size, num_splits, dtype", [
    (1, None, torch.float32), (16, 3, torch.bfloat16), (None, 8, torch.float32)])
def test_sliding_window(decode, paged_batch, windowed, close, device, block_size, num_splits, dtype, window):
    """Each sequence's last W keys split among programs; the keys before them are NaN
    behind placeholder blocks, so a read of one shows."""
    batch = paged_batch(SEQ_LENS, [1] * len(SEQ_LENS), 4, 2, 32, block_size, dtype, device)
    windowed(batch, window)
    args = decode_args(batch)
    out = decode.paged_decode_attention(**args, max_seq_len=max(SEQ_LENS), num_splits=num_splits,
                                        sliding_window=window)
    close(out, decode.paged_decode_attention_reference(**args, sliding_window=window))


def test_sliding_window_agrees_with_varlen_kernel(decode, paged_batch, windowed, device):
    """Decode and the varlen kernel read the same window (fp32)."""
    from servelab.kernels.varlen_attention import varlen_paged_attention

    batch = paged_batch(SEQ_LENS, [1] * len(SEQ_LENS), 4, 2, 32, 16, torch.float32, device)
    windowed(batch, 20)
    out = decode.paged_decode_attention(**decode_args(batch), num_splits=4, sliding_window=20)
    torch.testing.assert_close(out, varlen_paged_attention(**batch, sliding_window=20), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [48, 128])
def test_head_dims_and_default_bound(decode, paged_batch, close, device, head_dim):
    """Padded and large head dims; max_seq_len omitted (bounded by the block table)."""
    batch = paged_batch([29, 70], [1, 1], 2, 1, head_dim, 16, torch.bfloat16, device)
    args = decode_args(batch)
    out = decode.paged_decode_attention(**args)
    close(out, decode.paged_decode_attention_reference(**args))


def test_agrees_with_varlen_kernel(decode, paged_batch, device):
    """Decode and the varlen kernel (query_len 1) give the same answer in fp32."""
    from servelab.kernels.varlen_attention import varlen_paged_attention

    batch = paged_batch(SEQ_LENS, [1] * len(SEQ_LENS), 4, 2, 32, 16, torch.float32, device)
    out = decode.paged_decode_attention(**decode_args(batch), num_splits=4)
    torch.testing.assert_close(out, varlen_paged_attention(**batch), atol=1e-5, rtol=1e-5)


def test_strided_q_and_out_buffer(decode, paged_batch, close, device):
    """q may be a view of a fused qkv tensor; results land in the given out buffer."""
    batch = paged_batch([40, 9], [1, 1], 4, 2, 32, 16, torch.float32, device)
    args = decode_args(batch)
    args["q"] = torch.randn(2, 8, 32, device=device)[:, 2:6]
    out_buf = torch.zeros_like(args["q"])
    result = decode.paged_decode_attention(**args, out=out_buf)
    assert result is out_buf
    close(out_buf, decode.paged_decode_attention_reference(**args))


def test_choose_num_splits(decode):
    """Long contexts with few requests get several splits; big batches get one."""
    cpu = torch.device("cpu")
    assert decode.choose_num_splits(1, 1, 1, cpu) == 1
    assert decode.choose_num_splits(100_000, 1, 1, cpu) > 1
    assert decode.choose_num_splits(100_000, 1024, 8, cpu) == 1
    assert decode.choose_num_splits(10**9, 1, 1, cpu) <= decode.MAX_SPLITS


def test_rejects_bad_arguments(decode, paged_batch, device):
    """Shape, dtype and split-count errors raise ValueError."""
    args = decode_args(paged_batch([10, 4], [1, 1], 4, 2, 32, 16, torch.float32, device))
    bad = [
        {"q": args["q"].to(torch.bfloat16)},
        {"seq_lens": args["seq_lens"][:1]},
        {"block_table": args["block_table"].to(torch.int64)},
        {"num_splits": 0},
        {"num_splits": 1000},
        {"sliding_window": -1},
    ]
    for override in bad:
        with pytest.raises(ValueError):
            decode.paged_decode_attention(**{**args, **override})
