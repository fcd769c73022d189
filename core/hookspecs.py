"""Every hook servelab calls. Plugins implement them with ``@servelab.core.hookspecs.hookimpl``.

A plugin module that implements a ``servelab_register_*`` hook also declares
``SERVELAB_PLUGIN_API`` (see ``core/plugin_api.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from servelab.core.component import ComponentSpec
    from servelab.core.step_stats import StepStats

hookspec = pluggy.HookspecMarker("servelab")
hookimpl = pluggy.HookimplMarker("servelab")


@hookspec
def servelab_register_schedulers() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="scheduler", ...)`` entries; each class implements
    ``servelab.core.scheduler.Scheduler`` and is built as ``cls(config, SchedulerContext)``."""


@hookspec
def servelab_register_kv_caches() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="cache", ...)`` entries; each class implements
    ``servelab.core.kv_cache.KVCacheManager`` and is built as ``cls(config, CacheContext)``."""


@hookspec
def servelab_register_attention_backends() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="attention", ...)`` entries; each class implements
    ``servelab.core.attention.AttentionBackend`` and is built as ``cls(config, AttentionSpec)``."""


@hookspec
def servelab_register_decoding_strategies() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="decoding", ...)`` entries; each class implements
    ``servelab.core.decoding.DecodingStrategy`` and is built as ``cls(config, DecodingContext)``."""


@hookspec
def servelab_register_models() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="model", name=<config.json architecture>, ...)`` entries;
    each class implements ``servelab.core.model.CausalLM``."""


@hookspec
def servelab_register_eviction_policies() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="eviction", ...)`` entries; each class implements
    ``servelab.core.eviction.EvictionPolicy`` and is built as ``cls()``."""


@hookspec
def servelab_register_kv_tiers() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="kv_tier", ...)`` entries; each class implements
    ``servelab.core.kv_tier.KVTier`` and is built as ``cls(KVTierContext)`` (API 1.8)."""


@hookspec
def servelab_register_lora_stores() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="lora_store", ...)`` entries; each class implements
    ``servelab.core.lora_store.LoRAStore`` and is built as ``cls(LoRAStoreContext)`` (API 1.11)."""


@hookspec
def servelab_register_executors() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="executor", ...)`` entries; each class implements
    ``servelab.core.executor.Executor`` and is built as ``cls(config, ExecutorContext)``."""


@hookspec
def servelab_register_cost_models() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="cost_model", ...)`` entries; each class implements
    ``servelab.core.cost_model.CostModel`` and is built as ``cls(config, CostModelContext)``."""


@hookspec
def servelab_register_routers() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="router", ...)`` entries; each class implements
    ``servelab.core.router.Router`` and is built as ``cls(config, RouterContext)``."""


@hookspec
def servelab_register_kv_transfers() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="kv_transfer", ...)`` entries; each class implements
    ``servelab.core.kv_transfer.KVTransfer`` and is built as ``cls(config, KVTransferContext)``."""


@hookspec
def servelab_register_policies() -> list[ComponentSpec]:
    """Return ``ComponentSpec(kind="policy", ...)`` entries; each class implements
    ``servelab.core.policy.SchedulingPolicy`` and is built as ``cls(config, PolicyContext)``."""


@hookspec
def servelab_engine_started(engine: Any) -> None:
    """Called once when an engine (the ``LLMEngine``) is built and ready."""


@hookspec
def servelab_step_end(engine: Any, stats: StepStats) -> None:
    """Called once per engine step with the ``LLMEngine`` and that step's ``StepStats``."""


@hookspec
def servelab_engine_stopped(engine: Any) -> None:
    """Called once when an engine shuts down (``LLMEngine.shutdown``, which ``LLM.shutdown``
    and leaving ``with LLM(...)`` call); not for an engine collected without a shutdown,
    which no observer may hold on to."""
