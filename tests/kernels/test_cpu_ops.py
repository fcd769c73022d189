"""The native CPU ops (kernels/csrc/) against their torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.kernels.cpu_ops import native_cpu_unavailable_reason
from servelab.kernels.varlen_attention_reference import gather_context, varlen_paged_attention_reference
from servelab.plugins.attention.cache_ops import attention_mask, write_kv
from servelab.plugins.attention.sdpa import sdpa_one_request

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")

SCENARIOS = {
    "decode": [(1, 1), (50, 1), (97, 1), (16, 1)],
    "chunked_prefill": [(70, 16), (45, 13), (90, 8)],
    "spec_verify": [(60, 4), (81, 4), (33, 4)],
    "mixed": [(57, 1), (30, 30), (88, 12), (40, 0), (65, 5)],
}
CASES = [(sc, bs, gqa, dtype) for sc in SCENARIOS for bs, gqa, dtype in
         [(16, 4, torch.float32), (1, 2, torch.bfloat16), (None, 1, torch.float32), (32, 8, torch.bfloat16)]]


def ops():
    """The loaded op namespace."""
    return torch.ops.servelab_cpu


def tiled(kv_cache: torch.Tensor) -> torch.Tensor:
    """The standard [2, blocks, block_size, Hkv, D] cache in attention=cpu's layout
    [blocks, Hkv, 2, block_size * D]: per (block, head) the keys transposed ([D][block_size],
    or [D/2][block_size][2] for bfloat16 where the build scores dimension pairs), then the
    values row-major."""
    blocks, block_size, heads, head_dim = kv_cache.shape[1:]
    if kv_cache.dtype == torch.bfloat16 and ops().bf16_key_pairs():
        keys = kv_cache[0].reshape(blocks, block_size, heads, head_dim // 2, 2).permute(0, 2, 3, 1, 4)
    else:
        keys = kv_cache[0].permute(0, 2, 3, 1)
    values = kv_cache[1].permute(0, 2, 1, 3)
    return torch.stack([keys.reshape(blocks, heads, -1), values.reshape(blocks, heads, -1)], dim=2).contiguous()


def run_kernel(batch: dict, requests: list[int], window: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention over ``requests`` of ``batch`` (a tests/kernels/conftest.py batch)."""
    out = torch.zeros_like(batch["q"]) if out is None else out
    ops().paged_attention(out, batch["q"], tiled(batch["kv_cache"]), batch["block_table"], batch["query_start_loc"],
                          batch["seq_lens"], torch.tensor(requests, dtype=torch.int32), batch["scale"], window)
    return out


@pytest.mark.parametrize("scenario,block_size,gqa,dtype", CASES,
                         ids=[f"{sc}-bs{bs or 'contig'}-gqa{g}-{str(d)[6:]}" for sc, bs, g, d in CASES])
def test_paged_attention_matches_reference(paged_batch, close, scenario, block_size, gqa, dtype):
    """Every query row of every request equals the float32 reference within the dtype's tolerance."""
    seq_lens, query_lens = zip(*SCENARIOS[scenario])
    batch = paged_batch(list(seq_lens), list(query_lens), 2 * gqa, 2, 32, block_size, dtype)
    expected = varlen_paged_attention_reference(**{**batch, "q": batch["q"].float(),
                                                   "kv_cache": batch["kv_cache"].float()})
    close(run_kernel(batch, list(range(len(seq_lens)))), expected.to(dtype))


def test_paged_attention_writes_only_the_selected_requests(paged_batch):
    """Rows of requests left out of ``requests`` keep what ``out`` held."""
    batch = paged_batch([40, 20, 33], [1, 5, 1], 4, 2, 16, 16, torch.float32)
    out = run_kernel(batch, [0, 2], out=torch.full_like(batch["q"], 7.0))
    assert torch.equal(out[1:6], torch.full_like(out[1:6], 7.0))
    assert not torch.equal(out[0], torch.full_like(out[0], 7.0))


@pytest.mark.parametrize("head_dim,block_size,dtype", [(16, 8, torch.float32), (64, 16, torch.bfloat16)])
def test_paged_attention_sliding_window(paged_batch, close, head_dim, block_size, dtype):
    """With a window, each row sees only its last ``window`` positions (runs of positions
    that start inside a block; with bfloat16, scores from two 32-dimension tiles)."""
    window = 9
    batch = paged_batch([37, 50], [1, 6], 4, 2, head_dim, block_size, dtype)
    out = run_kernel(batch, [0, 1], window=window)
    starts = batch["query_start_loc"].tolist()
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        q = batch["q"][starts[r]:starts[r + 1]]
        k, v = gather_context(batch["kv_cache"], batch["block_table"][r], seq_len)
        mask = attention_mask(q.shape[0], seq_len, window, q.device)
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
            attn_mask=mask, scale=batch["scale"]).transpose(0, 1)
        close(out[starts[r]:starts[r + 1]], expected)


def test_paged_attention_reads_strided_queries(paged_batch, close):
    """q may be a column slice of a fused qkv tensor (row stride larger than H * D)."""
    batch = paged_batch([25, 40], [1, 1], 4, 2, 16, 16, torch.float32)
    fused = torch.randn(2, 4 * 16 + 32)
    fused[:, :64] = batch["q"].reshape(2, 64)
    strided = fused[:, :64].view(2, 4, 16)
    expected = run_kernel(batch, [0, 1])
    close(run_kernel({**batch, "q": strided}, [0, 1]), expected)


def test_paged_attention_rejects_bad_arguments(paged_batch):
    """Mismatched dtypes or index types name the problem instead of reading garbage."""
    batch = paged_batch([10], [1], 4, 2, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        run_kernel({**batch, "kv_cache": batch["kv_cache"].to(torch.bfloat16)}, [0])
    with pytest.raises(RuntimeError, match="head_dim 20 is not supported"):  # no multiple of any SIMD width
        run_kernel(paged_batch([10], [1], 4, 2, 20, 16, torch.float32), [0])
    with pytest.raises(RuntimeError, match="int32"):
        run_kernel({**batch, "seq_lens": batch["seq_lens"].long()}, [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_places_rows_in_the_tiled_layout(dtype):
    """Rows written at their slots read back like the standard layout's write; slot -1 is skipped."""
    blocks, block_size, heads, head_dim = 5, 4, 2, 16
    k, v = torch.randn(6, heads, head_dim).to(dtype), torch.randn(6, heads, head_dim).to(dtype)
    slots = torch.tensor([0, 7, 9, 19, -1, 3], dtype=torch.int64)
    standard = torch.zeros(2, blocks, block_size, heads, head_dim, dtype=dtype)
    keep = slots >= 0
    write_kv(standard, k[keep], v[keep], slots[keep])
    cache = torch.zeros(blocks, heads, 2, block_size * head_dim, dtype=dtype)
    ops().write_kv_cache(cache, k, v, slots)
    assert torch.equal(cache, tiled(standard))


def test_write_kv_cache_names_the_layout_it_expects():
    """A cache in another layout (here K/V on the first axis) is refused, naming the shape."""
    k = v = torch.randn(3, 4, 16)
    with pytest.raises(RuntimeError, match=r"\[blocks, Hkv, 2, block_size \* D\]"):
        ops().write_kv_cache(torch.zeros(2, 5, 4, 4 * 16), k, v, torch.arange(3))


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama RMSNorm formula (float32 statistics, rounded before the weight)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def assert_nearly_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within two units in the last place of the dtype (the float32 reductions run in another
    order); in bfloat16, where the rounding points decide, at least 99% exactly equal."""
    spacing = torch.finfo(expected.dtype).eps * expected.float().abs().clamp_min(1e-3)
    assert ((actual.float() - expected.float()).abs() <= 2 * spacing + 1e-6).all()
    if expected.dtype == torch.bfloat16:
        assert (actual == expected).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual_add(dtype):
    """rms_norm equals the torch formula; add_rms_norm also leaves x + residual in ``residual``."""
    x = torch.randn(37, 96).to(dtype)
    residual = torch.randn(37, 96).to(dtype)
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    out = torch.empty_like(x)
    ops().rms_norm(out, x, weight, 1e-6)
    assert_nearly_equal(out, torch_rms_norm(x, weight, 1e-6))
    total = x + residual
    x_copy, residual_copy = x.clone(), residual.clone()
    ops().add_rms_norm(x_copy, residual_copy, weight, 1e-6)
    assert torch.equal(residual_copy, total)
    assert_nearly_equal(x_copy, torch_rms_norm(total, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_rotary_embedding_in_place(dtype, head_dim):
    """Rotating strided q/k views in place equals the rotate-half formula in the dtype (head
    sizes whose halves are shorter than, a multiple of, and not a multiple of two vectors)."""
    half = head_dim // 2
    positions = torch.tensor([0, 5, 3, 17, 2], dtype=torch.int64)
    freqs = torch.arange(32)[:, None].float() * (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = torch.cat((freqs, freqs), -1)
    cos, sin = table.cos().to(dtype), table.sin().to(dtype)
    qkv = torch.randn(5, (4 + 2 + 2) * head_dim).to(dtype)
    q, k = qkv[:, :4 * head_dim].view(5, 4, head_dim), qkv[:, 4 * head_dim:6 * head_dim].view(5, 2, head_dim)

    def rotate(x):
        c, s = cos[positions][:, None], sin[positions][:, None]
        return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s

    expected_q, expected_k, untouched = rotate(q), rotate(k), qkv[:, 6 * head_dim:].clone()
    ops().rotary_embedding(q, k, positions, cos, sin)
    assert_nearly_equal(q, expected_q)
    assert_nearly_equal(k, expected_k)
    assert torch.equal(qkv[:, 6 * head_dim:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    """out = silu(gate) * up, for x = [gate | up]; float32 bit for bit with torch's
    vectorized SiLU (what a model's contiguous gate tensor goes through), rows whose last
    stretch is shorter than two vectors included; bfloat16 (a faster exp and reciprocal)
    within the rounding; gates far out in both tails and around where exp(-g) stops mattering
    (17.3) and turns denormal (87.3) included, in float32 infinities and NaN too."""
    x = (3 * torch.randn(9, 2 * 40)).to(dtype)
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.5, 0.0, 100.0, 1e4], dtype=dtype)
    x[1, :9] = torch.tensor([17.0, 17.4, 29.9, 30.0, 30.1, 87.3, 87.4, 95.0, -88.7], dtype=dtype)
    if dtype == torch.float32:
        x[1, 9:12] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = torch.empty(9, 40, dtype=dtype)
    ops().silu_and_mul(out, x)
    # Padded to a multiple of 64 elements, torch's SiLU has no scalar remainder loop.
    gates = F.pad(x[:, :40].reshape(-1), (0, 64 - 9 * 40 % 64))
    expected = F.silu(gates)[:9 * 40].view(9, 40) * x[:, 40:]
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert_nearly_equal(out[2:], expected[2:])  # random gates
    tails = expected[:2].isfinite()  # within the rounding (bfloat16 gives ~1e-34 where torch gives -0)
    torch.testing.assert_close(out[:2][tails].float(), expected[:2][tails].float(), rtol=2 * torch.finfo(dtype).eps,
                               atol=1e-6)


def test_argmax_rows_matches_torch_argmax():
    """First index of the maximum per row, ties and a vocabulary that is not a multiple of
    the SIMD width included; a NaN row answers its first NaN, as torch does."""
    torch.manual_seed(0)
    logits = torch.randn(37, 1003)
    logits[3, [5, 700]] = 50.0          # a tie: the first wins
    logits[4, 1002] = 60.0              # the maximum in the scalar tail
    logits[5] = float("-inf")
    logits[6, [9, 400]] = float("nan")
    logits[7, 1001] = float("nan")      # NaN only in the tail
    out = torch.empty(37, dtype=torch.long)
    ops().argmax_rows(out, logits)
    assert torch.equal(out, logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        ops().argmax_rows(out, logits.double())


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_of_a_long_vocabulary_split_in_chunks(threads):
    """Rows longer than a chunk (8192 logits) are scanned in pieces, split over the threads:
    a tie across chunks answers the first, a NaN in a later chunk beats a larger value in an
    earlier one, the first of two NaN chunks wins, and a single row answers as in a batch."""
    torch.manual_seed(1)
    logits = torch.randn(6, 40_003)
    logits[0, [100, 30_000]] = 50.0           # tie in chunks 0 and 3
    logits[1, 40_002] = 60.0                   # the last logit of the last (partial) chunk
    logits[2, 5] = 70.0
    logits[2, 20_000] = float("nan")           # NaN after the maximum
    logits[3, [9_000, 33_000]] = float("nan")  # NaN in chunks 1 and 4
    logits[4] = float("-inf")
    logits[5, 8_191:8_193] = 80.0              # a tie across a chunk boundary
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty(6, dtype=torch.long)
        ops().argmax_rows(out, logits)
        assert torch.equal(out, logits.argmax(dim=-1))
        for r in range(6):
            alone = torch.empty(1, dtype=torch.long)
            ops().argmax_rows(alone, logits[r:r + 1].clone())
            assert alone.item() == out[r].item()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_causal_prefill_attention_equals_sdpa_per_request(dtype, threads):
    """Off the tile unit (here: head_dim 16) each request's rows equal torch's causal SDPA
    over that request alone, bit for bit, whether requests run side by side or one by one;
    a request long enough to keep every thread and grouped-query heads included; rows of no
    listed request stay untouched."""
    torch.manual_seed(0)
    lengths = [3, 530, 40, 1, 17, 96]
    starts = [sum(lengths[:i]) + 5 for i in range(len(lengths))]
    total = starts[-1] + lengths[-1]
    q, k, v = torch.randn(total, 8, 16, dtype=dtype), torch.randn(total, 2, 16, dtype=dtype), torch.randn(total, 2, 16, dtype=dtype)
    out = torch.full_like(q, 7.0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops().causal_prefill_attention(out, q, k, v, starts, lengths, 0.25)
    finally:
        torch.set_num_threads(previous)
    for start, length in zip(starts, lengths):
        rows = slice(start, start + length)
        assert torch.equal(out[rows], sdpa_one_request(q[rows], k[rows], v[rows], 0.25, gqa=True))
    assert torch.equal(out[:5], torch.full_like(out[:5], 7.0))
    with pytest.raises(RuntimeError, match="starts and lengths"):
        ops().causal_prefill_attention(out, q, k, v, starts, lengths[:-1], 0.25)


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("threads", [1, 2])
def test_causal_prefill_attention_bfloat16_as_accurate_as_sdpa(head_dim, threads):
    """bfloat16 prefills at head sizes the AMX tile unit takes (multiples of 32; 96 leaves a
    half-width output column): every request's rows are as close to float32 attention as
    torch's own bfloat16 SDPA is, for prompts around the 16-row query and key blocks and the
    32-position value blocks, with q, k, v strided views of one projection output as in
    the model; rows of no listed request stay untouched."""
    torch.manual_seed(0)
    lengths = [1, 15, 16, 17, 33, 64, 65, 130, 530]
    starts = [sum(lengths[:i]) + 3 for i in range(len(lengths))]
    total = starts[-1] + lengths[-1]
    qkv = torch.randn(total, 12, head_dim, dtype=torch.bfloat16)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    out = torch.full((total, 8, head_dim), 7.0, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops().causal_prefill_attention(out, q, k, v, starts, lengths, scale)
    finally:
        torch.set_num_threads(previous)
    for start, length in zip(starts, lengths):
        rows = slice(start, start + length)
        exact = sdpa_one_request(q[rows].float(), k[rows].float(), v[rows].float(), scale, gqa=True)
        torch_error = (sdpa_one_request(q[rows], k[rows], v[rows], scale, gqa=True).float() - exact).abs().max()
        error = (out[rows].float() - exact).abs().max()
        assert error <= 1.25 * torch_error + 1e-3, (length, error.item(), torch_error.item())
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))
