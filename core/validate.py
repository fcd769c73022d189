"""Cross-component configuration checks, all in one place, reporting every problem."""

from __future__ import annotations

from typing import Any

from servelab.core.attention import AttentionSpec


def validate(cfg: Any, registry: Any, max_model_len: int, model_max_positions: int,
             attention_spec: AttentionSpec, cache: Any = None) -> list[str]:
    """Every reason ``cfg`` cannot run this model; empty when it can.

    ``cache`` (a built ``KVCacheManager``) adds the capacity check.
    """
    problems: list[str] = []
    if max_model_len > model_max_positions:
        problems.append(f"model.max_model_len={max_model_len} exceeds the model's "
                        f"max_position_embeddings={model_max_positions}")
    if max_model_len < 2:
        problems.append(f"model.max_model_len must be >= 2, got {max_model_len}")
    scheduler = cfg.scheduler
    chunked = "token_budget" in scheduler
    budget = scheduler.get("max_num_batched_tokens")
    if budget is not None and not chunked and budget < max_model_len:
        problems.append(f"scheduler.max_num_batched_tokens={budget} is below model.max_model_len={max_model_len}: "
                        f"a long prompt could never be scheduled; raise it or use scheduler=chunked")
    for key in ("max_num_seqs", "max_batch_size"):
        if key in scheduler and scheduler[key] < 1:
            problems.append(f"scheduler.{key} must be >= 1, got {scheduler[key]}")
    attention = registry.spec_for_config("attention", cfg.attention)
    problems += [f"attention={attention.name}: {reason}"
                 for reason in attention.cls.unsupported_reasons(cfg.attention, attention_spec)]
    if cache is not None and cache.max_tokens_per_request() < max_model_len:
        problems.append(f"the KV cache holds {cache.max_tokens_per_request()} tokens, fewer than "
                        f"model.max_model_len={max_model_len}: raise cache.memory_bytes / cache.num_blocks "
                        f"or lower model.max_model_len")
    return problems
