"""Every registered component (the built-ins and any installed plugin's) through the
conformance kits of ``servelab.testing``, as a third-party package runs them."""

from __future__ import annotations

from servelab.platform import free_port
from servelab.testing import (AttentionConformance, DecodingConformance, EntryPointConformance,
                              EvictionConformance, ExecutorConformance, KVCacheConformance, KVTierConformance,
                              KVTransferConformance, LoRAStoreConformance, PolicyConformance, SchedulerConformance,
                              StressConformance)


class TestKVCaches(KVCacheConformance):
    """Every cache."""


class TestAttentionBackends(AttentionConformance):
    """Every attention backend (selectors through the backend they pick)."""


class TestSchedulers(SchedulerConformance):
    """Every scheduler."""


class TestDecodingStrategies(DecodingConformance):
    """Every decoding strategy."""


class TestExecutors(ExecutorConformance):
    """Every executor, on one device and on two tensor-parallel ranks."""


class TestKVTransfers(KVTransferConformance):
    """Every KV transfer connector, within a process and across two."""

    configs = {"torch_distributed": {"port": free_port()}}  # not the default port another run may use


class TestEvictionPolicies(EvictionConformance):
    """Every prefix-cache eviction policy."""


class TestKVTiers(KVTierConformance):
    """Every KV tier below the host."""


class TestLoRAStores(LoRAStoreConformance):
    """Every adapter store."""


class TestPolicies(PolicyConformance):
    """Every scheduling policy under every scheduler."""


class TestStress(StressConformance):
    """Every scheduler under both preemption modes."""


class TestEveryComponentOffline(EntryPointConformance):
    """Every component of every group through the offline ``LLM`` API."""

    entry_points = ("llm",)


class TestConsoleScripts(EntryPointConformance):
    """The components that act across processes (a scheduler's step budget sizes the
    server's warm-up; a draft model loads in the engine process) through the console
    scripts; the defaults run in tests/server/test_console_scripts.py."""

    names = ("scheduler=chunked", "decoding=speculative")
    entry_points = ("servelab", "servelab-serve", "servelab-bench")
