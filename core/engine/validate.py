"""Cross-component configuration checks, on what the contracts expose (never on a plugin's
own config keys: each component checks those itself)."""

from __future__ import annotations

from servelab.core.kv_cache import KVCacheManager, KVCacheSpec, single_group


def validate(max_model_len: int, model_max_positions: int, cache: KVCacheManager | None,
             spec: KVCacheSpec | None = None, role: str = "mixed") -> list[str]:
    """Every reason the model's limits, the built ``cache`` (None when it failed to
    build; built for ``spec``) and the instance's ``role`` cannot work together; empty
    when they can."""
    problems: list[str] = []
    if max_model_len > model_max_positions:
        problems.append(f"model.max_model_len={max_model_len} exceeds the model's "
                        f"max_position_embeddings={model_max_positions}")
    if max_model_len < 2:
        problems.append(f"model.max_model_len must be >= 2, got {max_model_len}")
    if cache is not None and cache.max_tokens_per_request() < max_model_len:
        problems.append(f"the KV cache holds {cache.max_tokens_per_request()} tokens, fewer than "
                        f"model.max_model_len={max_model_len}: raise cache.memory_bytes / cache.num_blocks "
                        f"or lower model.max_model_len")
    allowed = () if spec is None else ((), spec.groups, single_group(spec))
    if cache is not None and spec is not None and cache.groups not in allowed:
        problems.append(f"cache={type(cache).__name__} keeps KV cache groups {cache.groups}: a cache keeps the "
                        f"spec's groups (KVCacheSpec.groups) or one group of every layer (single_group)")
    if cache is not None and role != "mixed" and len(cache.groups) > 1:
        problems.append(f"role={role}: handing requests between instances moves one block table per request, "
                        f"and this model's cache keeps {len(cache.groups)} KV cache groups (layers that differ "
                        f"in window); set cache.groups=false")
    return problems
