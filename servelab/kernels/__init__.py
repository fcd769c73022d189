"""servelab's kernels and their references: Triton kernels for the attention path, and
the native CPU ops of ``csrc/`` (``cpu_ops`` builds them; ``blocked_linear``,
``quantized_cpu``, ``w8a8_cpu``, ``kv_quantization`` and ``quantized_weights`` wrap and
define their layouts). The layers that call them live beside the models
(``plugins/models/linear.py``, ``quantized_linear.py``).

Triton ops (each module holds the Triton kernel and its checked Python wrapper;
the pure-torch references live in the ``*_reference`` modules):

- ``cache_write.write_kv_cache``: scatter new tokens' K/V into their cache slots.
- ``varlen_attention.varlen_paged_attention``: FlashAttention-2 style causal
  attention over a flat (unpadded) batch, reading the context through a block
  table; covers prefill, chunked prefill, speculative verification and decode.
- ``decode_attention.paged_decode_attention``: flash-decoding (split-K) for
  batches where every request has exactly one new token.
- ``fused_moe.fused_moe``: a mixture of experts' routed experts as grouped GEMMs over
  the (token, expert) pairs sorted and padded by expert (``align_by_expert``).
- ``availability.triton_unavailable_reason``: says why the kernels cannot run
  here (``None`` when they can).

KV cache layout, one tensor per layer:
``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` with keys in
``kv_cache[0]`` and values in ``kv_cache[1]`` (``kv_cache[1, ...]``, keys alone, when
each token's value is its key: latent attention); slot = block_id * block_size +
offset.  A contiguous cache is the same layout with one block of
``max_model_len`` tokens per request.

This package does not import triton at import time; the kernel modules do.

Imports nothing itself: run from the repository root, this folder is also importable as a
top-level ``kernels`` module, which other libraries probe for.
"""
