"""A plugin declares the plugin API versions it supports; servelab refuses the others at
registry load, naming the plugin, its range and servelab's version."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from servelab import PLUGIN_API_VERSION, ConfigError
from servelab.core.component import ComponentSpec
from servelab.core.hookspecs import hookimpl
from servelab.core.engine.registry import Registry
from servelab.plugins.scheduler.continuous import ContinuousScheduler


@dataclass
class EchoConfig:
    """A scheduler config for the test plugin."""

    max_num_seqs: int = 4


class SchedulerPlugin:
    """A plugin registering one scheduler, declaring ``supported``."""

    def __init__(self, supported: str | None):
        if supported is not None:
            self.SERVELAB_PLUGIN_API = supported

    @hookimpl
    def servelab_register_schedulers(self):
        return [ComponentSpec("scheduler", "echo", ContinuousScheduler, EchoConfig, "test")]


class Observer:
    """A plugin with observer hooks only: it needs no declaration."""

    @hookimpl
    def servelab_step_end(self, engine, stats):
        pass


def test_a_supporting_plugin_registers():
    registry = Registry(plugins=(SchedulerPlugin(f">={PLUGIN_API_VERSION},<99"), Observer()))
    assert "echo" in registry.specs("scheduler")


@pytest.mark.parametrize("supported", [">=0.1,<1", ">=99"])
def test_an_unsupporting_plugin_is_refused_with_both_versions(supported):
    with pytest.raises(ConfigError) as info:
        Registry(plugins=(SchedulerPlugin(supported),))
    (problem,) = info.value.problems
    assert "SchedulerPlugin" in problem and supported in problem and PLUGIN_API_VERSION in problem


def test_a_plugin_without_declaration_is_refused():
    with pytest.raises(ConfigError, match="declares no SERVELAB_PLUGIN_API"):
        Registry(plugins=(SchedulerPlugin(None),))


def test_a_malformed_declaration_is_named():
    with pytest.raises(ConfigError, match="not a version specifier"):
        Registry(plugins=(SchedulerPlugin("version one"),))


class FifoPlugin:
    """A plugin adding an eviction policy."""

    SERVELAB_PLUGIN_API = f">={PLUGIN_API_VERSION}"

    @hookimpl
    def servelab_register_eviction_policies(self):
        from servelab.plugins.cache.lru import LRUEviction

        return [ComponentSpec("eviction", "fifo", LRUEviction, None, "test")]


def test_the_engine_builds_every_component_from_its_registry():
    """A component the engine's registry has and the process-wide one lacks is found."""
    from servelab.core.entrypoints.compose import compose_config
    from servelab.core.engine.llm_engine import LLMEngine

    cfg = compose_config(["model=toy", "cache.enable_prefix_caching=true", "cache.eviction=fifo"])
    with pytest.raises(ConfigError, match="unknown eviction 'fifo'"):
        LLMEngine(cfg.copy())
    engine = LLMEngine(cfg, registry=Registry(plugins=(FifoPlugin(),)))
    assert type(engine.cache.prefix.eviction).__name__ == "LRUEviction"
