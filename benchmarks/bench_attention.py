"""GPU benchmark of servelab's Triton attention kernels against torch SDPA (and flash-attn /
flashinfer when importable).

Decode: achieved KV-read bandwidth (GB/s and % of --peak-gbps).  Prefill (no cache,
causal): TFLOP/s.  Llama-8B-like heads (32 query / 8 KV heads, head_dim 128), bf16,
batch sizes x context lengths, printed as markdown tables.  Needs CUDA; without it,
prints a message and exits 0.

    python benchmarks/bench_attention.py [--peak-gbps 4800] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from servelab.bench.report import render_markdown

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn()`` (triton.testing.do_bench: warmup, L2 flush, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def try_bench(fn) -> float | None:
    """``bench_ms`` or None when the backend fails (missing feature, out of memory...)."""
    try:
        return bench_ms(fn)
    except Exception as exc:  # noqa: BLE001 - a baseline failing must not stop the table
        print(f"  (baseline failed: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        torch.cuda.empty_cache()
        return None


def paged_cache(batch: int, ctx: int, block_size: int, dev: str):
    """Random paged KV cache holding ``batch`` contexts of ``ctx`` tokens, shuffled block table."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    table = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return kv, table, seq_lens


def dense_kv(kv, table, ctx: int):
    """The paged cache gathered into dense ``[B, ctx, Hkv, D]`` keys and values."""
    k = kv[0][table.long()].flatten(1, 2)[:, :ctx].contiguous()
    v = kv[1][table.long()].flatten(1, 2)[:, :ctx].contiguous()
    return k, v


def fmt(x: float | None, digits: int = 1) -> str:
    """Table cell: a number or n/a."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def decode_row(batch: int, ctx: int, args, dev: str) -> list[str]:
    """One decode configuration: our split-K kernel vs baselines, in GB/s of KV read."""
    from servelab.kernels.decode_attention import paged_decode_attention

    kv, table, seq_lens = paged_cache(batch, ctx, args.block_size, dev)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    scale = HEAD_DIM ** -0.5
    elt = kv.element_size()
    nbytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * elt + 2 * q.numel() * elt
    ours = lambda: paged_decode_attention(q, kv, seq_lens, table, scale, max_seq_len=ctx)  # noqa: E731
    t_ours = bench_ms(ours)
    k, v = dense_kv(kv, table, ctx)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], kt, vt, scale=scale, enable_gqa=True)  # noqa: E731
    ref = sdpa()[:, :, 0]
    err = (ours().float() - ref.float()).abs().max().item()
    results = {"sdpa": try_bench(sdpa)}
    try:
        from flash_attn import flash_attn_with_kvcache

        results["flash-attn"] = try_bench(lambda: flash_attn_with_kvcache(
            q[:, None], k, v, cache_seqlens=seq_lens, softmax_scale=scale, causal=True))
    except ImportError:
        results["flash-attn"] = None
    results["flashinfer"] = flashinfer_paged("decode", q, kv, table, ctx, args.block_size, scale)
    gbps = lambda ms: None if ms is None else nbytes / ms / 1e6  # noqa: E731
    return [str(batch), str(ctx), f"{t_ours * 1e3:.1f}", fmt(gbps(t_ours)),
            fmt(100 * gbps(t_ours) / args.peak_gbps), *(fmt(gbps(t)) for t in results.values()),
            f"{err:.1e}"]


def flashinfer_paged(kind: str, q, kv, table, ctx, block_size, scale, qsl=None) -> float | None:
    """flashinfer's paged ``decode`` or causal ``prefill`` (``qsl``: query start offsets) on
    the same cache, in ms (None if flashinfer is missing or fails)."""
    try:
        import flashinfer
    except ImportError:
        return None
    try:
        batch, blocks = table.shape
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        indptr = torch.arange(0, batch * blocks + 1, blocks, dtype=torch.int32, device=q.device)
        last = torch.full((batch,), ctx - (blocks - 1) * block_size, dtype=torch.int32, device=q.device)
        shape = (indptr, table.flatten(), last, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, block_size)
        if kind == "decode":
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(*shape, sm_scale=scale, q_data_type=q.dtype, kv_data_type=kv.dtype)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(qsl, *shape, causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=kv.dtype)
        return try_bench(lambda: wrapper.run(q, (kv[0], kv[1])))
    except Exception as exc:  # noqa: BLE001 - a baseline failing must not stop the table
        print(f"  (flashinfer {kind} failed: {exc!r:.120})", file=sys.stderr)
        return None


def prefill_row(batch: int, ctx: int, args, dev: str) -> list[str]:
    """One prefill configuration (prompt of ``ctx`` tokens per request, empty cache), TFLOP/s."""
    from servelab.kernels.varlen_attention import varlen_paged_attention

    kv, table, seq_lens = paged_cache(batch, ctx, args.block_size, dev)
    q = torch.randn(batch * ctx, NUM_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
    qsl = torch.arange(0, batch * ctx + 1, ctx, dtype=torch.int32, device=dev)
    scale = HEAD_DIM ** -0.5
    flops = 4 * batch * NUM_HEADS * HEAD_DIM * ctx * (ctx + 1) / 2  # causal QK^T + PV
    ours = lambda: varlen_paged_attention(q, kv, qsl, seq_lens, table, scale, ctx)  # noqa: E731
    t_ours = bench_ms(ours)
    k, v = dense_kv(kv, table, ctx)
    qd, kd, vd = (x.view(batch, ctx, -1, HEAD_DIM).transpose(1, 2) for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
        qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
    ref = sdpa().transpose(1, 2).reshape(batch * ctx, NUM_HEADS, HEAD_DIM)
    err = (ours().float() - ref.float()).abs().max().item()
    results = {"sdpa": try_bench(sdpa)}
    try:
        from flash_attn import flash_attn_varlen_func

        kf, vf = k.flatten(0, 1), v.flatten(0, 1)
        results["flash-attn"] = try_bench(lambda: flash_attn_varlen_func(
            q, kf, vf, qsl, qsl, ctx, ctx, softmax_scale=scale, causal=True))
    except ImportError:
        results["flash-attn"] = None
    results["flashinfer"] = flashinfer_paged("prefill", q, kv, table, ctx, args.block_size, scale, qsl)
    tflops = lambda ms: None if ms is None else flops / ms / 1e9  # noqa: E731
    return [str(batch), str(ctx), f"{t_ours:.3f}", fmt(tflops(t_ours)),
            *(fmt(tflops(t)) for t in results.values()), f"{err:.1e}"]


def table_rows(row, configs, args, dev: str) -> list[list[str]]:
    """``row(batch, context, args, dev)`` for each configuration; the GPU memory of one
    (its cache, gathered copies) is released before the next."""
    rows = []
    for batch, ctx in configs:
        rows.append(row(batch, ctx, args, dev))
        torch.cuda.empty_cache()
    return rows


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A titled markdown table, numbers right-aligned."""
    print(f"\n### {title}\n")
    print(render_markdown(header, rows, align="r" * len(header)), end="")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run decode and prefill sweeps, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak (H200: 4800 GB/s)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size (tokens)")
    parser.add_argument("--max-prefill-tokens", type=int, default=131072,
                        help="skip prefill configurations with more tokens (batch x context)")
    parser.add_argument("--quick", action="store_true", help="batch 1, 8 and context 512, 2048 only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU available; this benchmark times GPU kernels only. Skipping.")
        return 0
    if args.quick:
        args.batch_sizes, args.context_lens = [1, 8], [512, 2048]
    dev = "cuda"
    torch.manual_seed(0)
    print(f"# Attention kernels on {torch.cuda.get_device_name()} (H={NUM_HEADS}, Hkv={NUM_KV_HEADS}, "
          f"D={HEAD_DIM}, bf16, block_size={args.block_size}); err = max |ours - sdpa|")
    baselines = ["sdpa", "flash-attn", "flashinfer"]
    rows = table_rows(decode_row, [(b, c) for b in args.batch_sizes for c in args.context_lens], args, dev)
    print_table(f"Decode (one new token per request; GB/s of KV read, peak {args.peak_gbps:.0f})",
                ["batch", "context", "ours us", "ours GB/s", "% peak", *(f"{b} GB/s" for b in baselines), "err"],
                rows)
    rows = table_rows(prefill_row, [(b, c) for b in args.batch_sizes for c in args.context_lens
                                    if b * c <= args.max_prefill_tokens], args, dev)
    print_table("Prefill (causal, no cache; TFLOP/s)",
                ["batch", "context", "ours ms", "ours TFLOP/s", *(f"{b} TFLOP/s" for b in baselines), "err"],
                rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
