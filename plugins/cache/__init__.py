"""KV cache managers: paged (PagedAttention) and contiguous (per-request reservation)."""
