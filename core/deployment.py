"""How many engine instances serve, in which role: the ``deployment`` config group of
``servelab-serve`` and ``servelab-bench``.

``deployment=single`` is one mixed engine (prefill and decode together, the default).
``deployment=disaggregated`` runs a pool of prefill instances and a pool of decode
instances (docs/disaggregation.md): a prefill instance runs a request up to its first
token and hands its KV cache to a decode instance through the ``kv_transfer`` connector.
Each pool's engines are built from the app's config with the pool's own Hydra overrides
on top (``deployment.prefill.overrides='["scheduler=chunked"]'``; in simulation also
``hardware=...`` and ``parallel.*``) and its ``role`` set: ``compose_pool_config`` in
``servelab.core.entrypoints.compose``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

ROLES = ("mixed", "prefill", "decode")
"""Instance roles: ``mixed`` runs requests from prompt to end (one engine as always);
``prefill`` runs them up to their first token and hands them off; ``decode`` admits
handed-off requests and generates the rest."""


@dataclass
class PoolConfig:
    """One pool of a disaggregated deployment: ``instances`` engines, each the app's
    config with ``overrides`` (Hydra overrides, e.g. ``["scheduler=chunked"]``) applied;
    ``engine_threads`` compute threads each (null: this process's cores split evenly over
    every instance of the deployment, at least one each; on Ray, ``server.replica_cpus``).
    ``ray_resources``: with ``server.backend=ray``, the custom Ray resources each instance
    reserves, which place the pool on the machines started with them
    (``ray start --resources='{"prefill": 8}'``)."""

    instances: int = 1
    overrides: list[str] = field(default_factory=list)
    engine_threads: Optional[int] = None
    ray_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class SingleDeploymentConfig:
    """``deployment=single``: one mixed engine."""

    name: str = "single"


@dataclass
class DisaggregatedDeploymentConfig:
    """``deployment=disaggregated``: ``prefill`` and ``decode`` pools; the ``router``
    chooses an instance of each pool per request, the ``kv_transfer`` connector moves
    the KV cache between them. ``link``: what a simulated deployment moves it over, one of
    the ``links`` of both pools' ``hardware`` (nvlink, pcie, infiniband, roce)."""

    name: str = "disaggregated"
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    link: str = "nvlink"


DEPLOYMENTS = {"single": SingleDeploymentConfig, "disaggregated": DisaggregatedDeploymentConfig}


def store_deployment_options() -> None:
    """Put the ``deployment`` group's options into Hydra's ConfigStore."""
    store = ConfigStore.instance()
    for name, node in DEPLOYMENTS.items():
        store.store(group="deployment", name=name, node=node)


def is_disaggregated(cfg: DictConfig) -> bool:
    """True when ``cfg`` deploys prefill and decode pools."""
    deployment = cfg.get("deployment")
    return deployment is not None and deployment.name == "disaggregated"


def pool_problems(cfg: DictConfig) -> list[str]:
    """Every problem of the deployment's pools, each naming its field."""
    if not is_disaggregated(cfg):
        return []
    problems = []
    if cfg.get("role", "mixed") != "mixed":
        problems.append(f"role={cfg.role} is set per pool by deployment=disaggregated; leave role=mixed")
    for role in ("prefill", "decode"):
        pool = cfg.deployment[role]
        if pool.instances < 1:
            problems.append(f"deployment.{role}.instances must be at least 1, got {pool.instances}")
        if pool.engine_threads is not None and pool.engine_threads < 1:
            problems.append(f"deployment.{role}.engine_threads must be at least 1 (or null), got {pool.engine_threads}")
        for override in pool.overrides:
            key = str(override).lstrip("+~").split("=", 1)[0]
            if "=" not in str(override) or key.split(".")[0] in ("deployment", "role", "server"):
                problems.append(f"deployment.{role}.overrides: {override!r} must be an engine override "
                                f"(group=option or key=value, not deployment, role or server)")
    return problems
