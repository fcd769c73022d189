"""Every hook servelab calls. Plugins implement them with ``@servelab.core.hookspecs.hookimpl``."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("servelab")
hookimpl = pluggy.HookimplMarker("servelab")


@hookspec
def servelab_register_schedulers() -> list:
    """Return ``ComponentSpec(kind="scheduler", ...)`` entries; each class implements
    ``servelab.core.scheduler.Scheduler`` and is built as ``cls(config, context)``."""


@hookspec
def servelab_register_kv_caches() -> list:
    """Return ``ComponentSpec(kind="cache", ...)`` entries; each class implements
    ``servelab.core.kv_cache.KVCacheManager`` and is built as ``cls(config, spec)``."""


@hookspec
def servelab_register_attention_backends() -> list:
    """Return ``ComponentSpec(kind="attention", ...)`` entries; each class implements
    ``servelab.core.attention.AttentionBackend`` and is built as ``cls(config, spec)``."""


@hookspec
def servelab_register_decoding_strategies() -> list:
    """Return ``ComponentSpec(kind="decoding", ...)`` entries; each class implements
    ``servelab.core.decoding.DecodingStrategy`` and is built as ``cls(config, context)``."""


@hookspec
def servelab_register_models() -> list:
    """Return ``ComponentSpec(kind="model", name=<config.json architecture>, ...)`` entries;
    each class implements ``servelab.core.model.CausalLM``."""


@hookspec
def servelab_register_eviction_policies() -> list:
    """Return ``ComponentSpec(kind="eviction", ...)`` entries for prefix-cache eviction."""


@hookspec
def servelab_engine_started(engine) -> None:
    """Called once when an engine is built and ready."""


@hookspec
def servelab_step_end(engine, stats) -> None:
    """Called once per engine step with that step's ``StepStats``."""


@hookspec
def servelab_engine_stopped(engine) -> None:
    """Called once when an engine shuts down."""
