"""varlen_paged_attention (Triton) vs its torch reference, and the reference vs dense SDPA."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from servelab.kernels.varlen_attention_reference import varlen_paged_attention_reference

# (seq_len, query_len) per request; context lengths mostly not multiples of block sizes.
SCENARIOS = {
    "prefill": [(23, 23), (33, 33), (5, 5)],
    "chunked_prefill": [(70, 16), (45, 13), (90, 8)],
    "spec_verify": [(60, 4), (81, 4), (33, 4)],
    "decode": [(1, 1), (50, 1), (97, 1), (16, 1)],
    "mixed": [(57, 1), (30, 30), (88, 12), (40, 0), (65, 5)],
}
BLOCK_SIZES = [1, 16, 32, None]  # None: contiguous layout, one big block per request
GQA = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]

# Every (block size, scenario) pair once, cycling the GQA ratio and dtype through them.
CASES = [
    pytest.param(bs, sc, GQA[i % 3], DTYPES[i % 2],
                 id=f"bs{bs or 'contig'}-{sc}-gqa{GQA[i % 3]}-{str(DTYPES[i % 2])[6:]}")
    for i, (bs, sc) in enumerate(itertools.product(BLOCK_SIZES, SCENARIOS))
]


@pytest.fixture
def attn():
    """The Triton wrapper (imported lazily so the SDPA anchor runs without triton)."""
    return pytest.importorskip("servelab.kernels.varlen_attention").varlen_paged_attention


def run_both(attn, batch):
    """Kernel output and reference output for one batch."""
    ref = varlen_paged_attention_reference(**batch)
    return attn(**batch), ref


def test_reference_matches_dense_sdpa(paged_batch):
    """Anchor: for a no-cache prefill the reference equals causal SDPA per request."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    pairs = [(19, 19), (32, 32), (7, 7)]
    batch = paged_batch([s for s, _ in pairs], [q for _, q in pairs], num_heads, num_kv_heads,
                        head_dim, 16, torch.float32)
    out = varlen_paged_attention_reference(**batch)
    starts = batch["query_start_loc"].tolist()
    for r, (seq_len, _) in enumerate(pairs):
        k = torch.cat([batch["kv_cache"][0, b] for b in batch["block_table"][r].tolist()])[:seq_len]
        v = torch.cat([batch["kv_cache"][1, b] for b in batch["block_table"][r].tolist()])[:seq_len]
        q = batch["q"][starts[r]:starts[r + 1]]
        group = num_heads // num_kv_heads
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=batch["scale"],
        ).transpose(0, 1)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], expected, atol=1e-5, rtol=1e-5)


def test_reference_window_matches_masked_sdpa(paged_batch):
    """Anchor: with a window, the reference equals SDPA under an explicit causal-window mask."""
    window, pairs = 6, [(40, 9), (12, 12)]
    batch = paged_batch([s for s, _ in pairs], [q for _, q in pairs], 2, 2, 16, 16, torch.float32)
    out = varlen_paged_attention_reference(**batch, sliding_window=window)
    starts = batch["query_start_loc"].tolist()
    for r, (seq_len, q_len) in enumerate(pairs):
        k = torch.cat([batch["kv_cache"][0, b] for b in batch["block_table"][r].tolist()])[:seq_len]
        v = torch.cat([batch["kv_cache"][1, b] for b in batch["block_table"][r].tolist()])[:seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        expected = F.scaled_dot_product_attention(
            batch["q"][starts[r]:starts[r + 1]].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=batch["scale"],
        ).transpose(0, 1)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 40, 200])
@pytest.mark.parametrize("block_size", [1, 16, None])
def test_sliding_window(attn, paged_batch, windowed, close, device, block_size, window):
    """Windows inside one key tile, across tiles and past the context, on a mixed batch
    (a two-tile prefill, chunks, decode); keys before each window are NaN behind
    placeholder blocks, so a read of one shows."""
    seq_lens, query_lens = zip(*SCENARIOS["mixed"])
    batch = paged_batch(list(seq_lens), list(query_lens), 4, 2, 32, block_size, torch.float32, device)
    windowed(batch, window)
    out = attn(**batch, sliding_window=window)
    close(out, varlen_paged_attention_reference(**batch, sliding_window=window))


@pytest.mark.parametrize("block_size, scenario, gqa, dtype", CASES)
def test_matches_reference(attn, paged_batch, close, device, block_size, scenario, gqa, dtype):
    """All scenarios x block sizes (shuffled tables), GQA 1/2/4, fp32 and bf16."""
    seq_lens, query_lens = zip(*SCENARIOS[scenario])
    batch = paged_batch(list(seq_lens), list(query_lens), 4, 4 // gqa, 32, block_size, dtype, device)
    out, ref = run_both(attn, batch)
    close(out, ref)


@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_gqa(attn, paged_batch, close, device, gqa, dtype):
    """Full dtype x GQA grid on one mixed batch with head_dim 64."""
    seq_lens, query_lens = zip(*SCENARIOS["mixed"])
    batch = paged_batch(list(seq_lens), list(query_lens), 4, 4 // gqa, 64, 16, dtype, device)
    out, ref = run_both(attn, batch)
    close(out, ref)


@pytest.mark.parametrize("head_dim, pairs", [
    (16, [(40, 9), (17, 17)]),
    (48, [(40, 9), (17, 17)]),
    (128, [(37, 3), (20, 1)]),
])
def test_head_dims(attn, paged_batch, close, device, head_dim, pairs):
    """Power-of-two and padded (non power-of-two) head dims."""
    batch = paged_batch([s for s, _ in pairs], [q for _, q in pairs], 2, 1, head_dim, 16,
                        torch.bfloat16, device)
    out, ref = run_both(attn, batch)
    close(out, ref)


def test_strided_q_and_out_buffer(attn, paged_batch, close, device):
    """q may be a view into a fused qkv tensor; results land in the given out buffer."""
    seq_lens, query_lens = zip(*SCENARIOS["chunked_prefill"])
    batch = paged_batch(list(seq_lens), list(query_lens), 4, 2, 32, 16, torch.float32, device)
    qkv = torch.randn(batch["q"].shape[0], 8, 32, device=device)
    batch["q"] = qkv[:, :4]
    out_buf = torch.full_like(batch["q"], 7.0)
    ref = varlen_paged_attention_reference(**batch)
    result = attn(**{**batch, "out": out_buf})
    assert result is out_buf
    close(out_buf, ref)


def test_write_then_attend(attn, paged_batch, close, device):
    """Engine flow: write the new tokens' K/V with write_kv_cache, then attend over the cache."""
    from servelab.kernels.cache_write import write_kv_cache

    seq_lens, query_lens = [50, 20], [10, 20]
    batch = paged_batch(seq_lens, query_lens, 4, 2, 32, 16, torch.float32, device)
    block_size, table = batch["kv_cache"].shape[2], batch["block_table"].cpu()
    slots = []
    for r, (s, q_len) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(s - q_len, s):
            slots.append(int(table[r, pos // block_size]) * block_size + pos % block_size)
    key = torch.randn(sum(query_lens), 2, 32, device=device)
    value = torch.randn_like(key)
    write_kv_cache(key, value, batch["kv_cache"], torch.tensor(slots, device=device))
    out, ref = run_both(attn, batch)
    close(out, ref)
    # The reference must see the freshly written keys (the cache really changed).
    k_ctx = batch["kv_cache"][0, int(table[1, 1]), 3]
    torch.testing.assert_close(k_ctx, key[10 + 16 + 3])


def test_rejects_bad_arguments(attn, paged_batch, device):
    """Shape, dtype and layout errors raise ValueError before launching."""
    batch = paged_batch([10], [10], 4, 2, 32, 16, torch.float32, device)
    bad = [
        {"q": batch["q"].to(torch.float16)},                          # dtype mismatch with cache
        {"q": batch["q"][..., :16]},                                  # head_dim mismatch
        {"seq_lens": batch["seq_lens"].long()},                       # wrong index dtype
        {"block_table": batch["block_table"].t().contiguous()},       # wrong shape
        {"kv_cache": batch["kv_cache"][0]},                           # not [2, ...]
        {"q": batch["q"][:, :3]},                                     # 3 heads over 2 KV heads
        {"out": torch.empty(1, 4, 32, device=device)},                # out shape
        {"sliding_window": 0},                                        # window must be >= 1
    ]
    for override in bad:
        with pytest.raises(ValueError):
            attn(**{**batch, **override})


@pytest.mark.parametrize("block_size", [1, 16])
def test_token_tree_mask(attn, paged_batch, close, device, block_size):
    """Token trees (the last keys of a request, each row reading its ancestors): a
    verified tree of 7 nodes, a drafted level of 3 new nodes in a tree of 6, and a plain
    decode beside them; the reference equals SDPA under the explicit mask."""
    from servelab.core.token_tree import ancestor_mask

    trees = [[-1, 0, 0, 1, 2, 2, 1], [-1, -1, 0, 1, 1, 0], []]
    pairs = [(36, 7), (22, 3), (30, 1)]
    batch = paged_batch([s for s, _ in pairs], [q for _, q in pairs], 4, 2, 32, block_size, torch.float32, device)
    mask = torch.zeros(sum(q for _, q in pairs), 7, dtype=torch.bool)
    row = 0
    for tree, (_, q_len) in zip(trees, pairs):
        if tree:
            mask[row:row + q_len, :len(tree)] = torch.from_numpy(ancestor_mask(tree)[len(tree) - q_len:])
        row += q_len
    tree_args = dict(tree_mask=mask.to(device), tree_lens=torch.tensor([7, 6, 0], dtype=torch.int32, device=device))
    ref = varlen_paged_attention_reference(**batch, **tree_args)
    close(attn(**batch, **tree_args), ref)
    starts = batch["query_start_loc"].tolist()
    for r, ((seq_len, q_len), tree) in enumerate(zip(pairs, trees)):
        k = torch.cat([batch["kv_cache"][0, b] for b in batch["block_table"][r].tolist()])[:seq_len].cpu()
        v = torch.cat([batch["kv_cache"][1, b] for b in batch["block_table"][r].tolist()])[:seq_len].cpu()
        allowed = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        if tree:
            allowed[:, seq_len - len(tree):] = torch.from_numpy(ancestor_mask(tree)[len(tree) - q_len:])
        expected = F.scaled_dot_product_attention(
            batch["q"][starts[r]:starts[r + 1]].cpu().transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
            v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=allowed, scale=batch["scale"]).transpose(0, 1)
        torch.testing.assert_close(ref[starts[r]:starts[r + 1]].cpu(), expected, atol=1e-5, rtol=1e-5)
