"""The engine processes ``servelab-serve`` starts for its ``deployment``: one mixed engine,
or prefill and decode pools (core/deployment.py), each instance with its compute threads
and, when the cores go round, cores of its own."""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from servelab.core.deployment import is_disaggregated, pool_problems
from servelab.core.entrypoints.compose import compose_pool_config
from servelab.core.errors import ConfigError
from servelab.server.engine_process import InstancePlan

POOLS = ("prefill", "decode")


def deployment_service(cfg: DictConfig) -> contextlib.AbstractContextManager:
    """What the server holds open while a disaggregated deployment's instances run: its
    ``kv_transfer`` connector's ``host_deployment`` (nothing for one engine)."""
    if not is_disaggregated(cfg):
        return contextlib.nullcontext()
    from servelab.core.engine.registry import get_registry

    spec = get_registry().spec_for_config("kv_transfer", cfg.kv_transfer)
    return spec.cls.host_deployment(OmegaConf.to_object(cfg.kv_transfer))


def plan_instances(cfg: DictConfig, base_overrides: Sequence[str] | None = None, config_name: str = "serve",
                   cores: Sequence[int] | None = None) -> list[InstancePlan]:
    """The engine processes of ``cfg``'s deployment, prefill instances first: ``engine``
    for ``deployment=single``, else ``prefill-0..`` and ``decode-0..``, each pool's config
    composed from ``base_overrides`` (the app's) and the pool's overrides. ``cores`` (default:
    the ones this process may use) are split among the instances: each gets its pool's
    ``engine_threads`` (default: an even share, at least one) and, when every thread has a
    core, cores no other instance uses. ``ConfigError`` names every problem."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if not is_disaggregated(cfg):
        return [InstancePlan("engine", cfg, cfg.server.engine_threads)]
    problems = pool_problems(cfg)
    if problems:
        raise ConfigError(problems)
    deployment = cfg.deployment
    total = sum(deployment[pool].instances for pool in POOLS)
    share = max(1, len(cores) // total)
    threads = {pool: deployment[pool].engine_threads or share for pool in POOLS}
    asked = sum(threads[pool] * deployment[pool].instances for pool in POOLS)
    explicit = any(deployment[pool].engine_threads is not None for pool in POOLS)
    if explicit and asked > len(cores):
        raise ConfigError([f"deployment asks for {asked} compute threads (deployment.prefill.engine_threads x "
                           f"deployment.prefill.instances + deployment.decode.engine_threads x "
                           f"deployment.decode.instances), more than the {len(cores)} cores this server may use"])
    pinned = asked <= len(cores)
    plans, next_core = [], 0
    for pool in POOLS:
        pool_cfg = compose_pool_config(cfg, pool, base_overrides, config_name)
        for index in range(deployment[pool].instances):
            own = None
            if pinned:
                own = tuple(cores[next_core:next_core + threads[pool]])
                next_core += threads[pool]
            plans.append(InstancePlan(f"{pool}-{index}", pool_cfg, threads[pool], own))
    return plans
