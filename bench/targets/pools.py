"""The two pools of a simulated ``deployment=disaggregated``: their engines, checked
against each other, and the link a KV cache crosses between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from servelab.bench.targets.inproc import ServelabSystem
from servelab.core.config import LinkConfig
from servelab.core.deployment import pool_problems
from servelab.core.errors import ConfigError

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class KVLink:
    """What a hand-off crosses: link ``name`` at ``bandwidth`` bytes/s one way with a fixed
    ``latency_s`` per transfer (the slower end's figures: the smaller bandwidth, the larger
    latency of the two pools' ``hardware.links``), over ``streams`` such links in parallel
    (the fewer devices of the two instances, each sending its share)."""

    name: str
    bandwidth: float
    latency_s: float
    streams: int

    @property
    def figures(self) -> LinkConfig:
        """One link's figures, as ``SimulatedTransfer.price`` reads them."""
        return LinkConfig(self.bandwidth, self.latency_s)


def pool_configs(cfg: DictConfig, base_overrides: Sequence[str] | None) -> dict[str, DictConfig]:
    """The config of each pool's instances (``deployment.<pool>.overrides`` on top of the
    app's ``base_overrides``); ``ConfigError`` naming every problem of the deployment."""
    from servelab.core.entrypoints.compose import compose_pool_config

    problems = pool_problems(cfg)
    if cfg.target.replicas != 1:
        problems.append(f"target.replicas={cfg.target.replicas} does not combine with deployment=disaggregated: "
                        f"size the pools with deployment.prefill.instances and deployment.decode.instances")
    if problems:
        raise ConfigError(problems)
    return {role: compose_pool_config(cfg, role, base_overrides, "bench") for role in ROLES}


def check_simulated(configs: dict[str, DictConfig]) -> None:
    """``ConfigError`` unless every pool runs ``executor=simulated``."""
    from servelab.core.engine.registry import get_registry

    registry = get_registry()
    problems = []
    for role, pool in configs.items():
        spec = registry.spec_for_config("executor", pool.executor)
        if spec.cls.runs_model:
            problems.append(f"deployment=disaggregated in servelab-bench runs simulated pools (executor=simulated); "
                            f"deployment.{role} has executor={spec.name}. Measure real pools with servelab-serve "
                            f"deployment=disaggregated and servelab-bench target=http")
    if problems:
        raise ConfigError(problems)


def check_same_blocks(prefill: ServelabSystem, decode: ServelabSystem) -> None:
    """``ConfigError`` unless both pools store the same KV blocks (model, block size, KV dtype)."""
    sent, taken = prefill.engine.executor.local_kv_caches(), decode.engine.executor.local_kv_caches()
    shape = [(len(c), tuple(c[0].shape[1:]), c[0].dtype) for c in (sent, taken)]
    if shape[0] != shape[1]:
        raise ConfigError([f"deployment.prefill and deployment.decode must store the same KV blocks (the same model, "
                           f"cache.block_size and cache.kv_dtype): layers, block shape and dtype are {shape[0]} "
                           f"against {shape[1]}"])


def resolve_link(cfg: DictConfig, configs: dict[str, DictConfig]) -> KVLink:
    """The link ``deployment.link`` names, from both pools' hardware; ``ConfigError``
    naming the setting and the links a pool's hardware has when one lacks it."""
    name = cfg.deployment.link
    figures, problems = [], []
    for role, pool in configs.items():
        links = pool.hardware.links
        if name not in links:
            problems.append(f"deployment.link={name!r}: hardware={pool.hardware.name} of deployment.{role} has no such "
                            f"link (it has {', '.join(links) or 'none'}; add one under hardware.links)")
            continue
        link = OmegaConf.to_object(links[name])
        if link.bandwidth <= 0 or link.latency_s < 0:
            problems.append(f"hardware.links.{name} of deployment.{role} (hardware={pool.hardware.name}) needs "
                            f"bandwidth > 0 and latency_s >= 0, got {link.bandwidth} and {link.latency_s}")
        figures.append(link)
    if problems:
        raise ConfigError(problems)
    devices = [pool.parallel.tensor_parallel_size * pool.parallel.pipeline_parallel_size for pool in configs.values()]
    return KVLink(name, min(f.bandwidth for f in figures), max(f.latency_s for f in figures), min(devices))


def pool_summary(cfg: DictConfig, stats: Sequence[dict[str, Any]], routed: Sequence[int], span: float) -> dict[str, Any]:
    """One pool for ``metrics.json``: its instances' hardware and split, each one's busy
    fraction of the run's ``span`` seconds and their mean (``utilisation``), requests
    routed, peak KV usage and steps (``stats``: each instance's ``StepObserver`` summary)."""
    busy = [s["busy_s"] / span if span > 0 else None for s in stats]
    return {"instances": len(stats), "hardware": cfg.hardware.name,
            "tensor_parallel_size": cfg.parallel.tensor_parallel_size,
            "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
            "utilisation": sum(busy) / len(busy) if span > 0 else None, "busy_fraction": busy,
            "routed": list(routed), "kv_peak_usage": [s["kv_peak_usage"] for s in stats],
            "num_steps": [s["num_steps"] for s in stats]}
