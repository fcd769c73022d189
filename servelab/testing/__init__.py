"""Helpers and conformance kits for servelab and third-party plugin authors.

The oracle: ``assert_engine_matches_transformers(folder, overrides)`` checks greedy tokens
against Hugging Face transformers in float32 and that no KV block leaked;
``tiny_checkpoint(folder, family)`` writes a tiny random model to test on.

The kits are pytest test classes, one per contract, parametrized over the registry
(every registered component of their kind, third-party ones included) or over the
``names`` a subclass lists. A plugin package runs the same suite as the built-ins with
one line per kit in its tests::

    from servelab.testing import SchedulerConformance

    class TestMyScheduler(SchedulerConformance): names = ("my_scheduler",)

``KVCacheConformance``, ``AttentionConformance``, ``SchedulerConformance``,
``DecodingConformance``, ``ExecutorConformance``, ``KVTransferConformance``, ``PolicyConformance``, ``EvictionConformance``,
``KVTierConformance``, ``LoRAStoreConformance``,
``EntryPointConformance`` and
``StressConformance``; see docs/plugins.md for what each checks. ``ProcessResources``
and ``assert_released`` check that an engine left nothing in the process.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FAMILIES": "servelab.testing.oracle",
    "tiny_config": "servelab.testing.oracle",
    "tiny_checkpoint": "servelab.testing.oracle",
    "mixed_prompts": "servelab.testing.oracle",
    "hot_prefix_prompts": "servelab.testing.oracle",
    "transformers_greedy": "servelab.testing.oracle",
    "assert_engine_matches_transformers": "servelab.testing.oracle",
    "assert_no_leaked_blocks": "servelab.testing.oracle",
    "ConformanceKit": "servelab.testing.kit",
    "KVCacheConformance": "servelab.testing.cache_kit",
    "AttentionConformance": "servelab.testing.attention_kit",
    "SchedulerConformance": "servelab.testing.scheduler_kit",
    "DecodingConformance": "servelab.testing.decoding_kit",
    "ExecutorConformance": "servelab.testing.executor_kit",
    "KVTransferConformance": "servelab.testing.kv_transfer_kit",
    "PolicyConformance": "servelab.testing.policy_kit",
    "EvictionConformance": "servelab.testing.eviction_kit",
    "KVTierConformance": "servelab.testing.kv_tier_kit",
    "LoRAStoreConformance": "servelab.testing.lora_store_kit",
    "ProcessResources": "servelab.testing.lifecycle",
    "assert_released": "servelab.testing.lifecycle",
    "EntryPointConformance": "servelab.testing.entry_point_kit",
    "StressConformance": "servelab.testing.stress",
    "run_stress": "servelab.testing.stress",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Import a public name from its module on first access (pytest and hypothesis load
    only with the kits)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'servelab.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
