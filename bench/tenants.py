"""A workload of several tenants (``workload.tenants``): each client's own arrivals,
lengths, priority and SLO class, merged into one stream of requests."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from servelab.bench.config import TenantConfig
from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.request_metadata import RequestMetadata

CLIENT_FIELDS = ("num_requests", "arrival", "burstiness", "lengths", "input_len", "output_len", "input_range",
                 "output_range")
"""Fields of ``TenantConfig`` that replace the workload's own when set."""


def _problems(name: str, tenant: Any) -> list[str]:
    where = f"workload.tenants.{name}"
    problems = []
    if tenant.rate is None or not tenant.rate > 0:
        problems.append(f"{where}.rate must be > 0 requests/s, got {tenant.rate}")
    if tenant.num_requests is not None and tenant.num_requests < 1:
        problems.append(f"{where}.num_requests must be >= 1 (null: its share by rate), got {tenant.num_requests}")
    try:
        RequestMetadata(priority=tenant.priority, tenant=name, slo_class=tenant.slo_class)
    except InvalidRequestError as exc:
        problems.append(f"{where}.{exc.field if exc.field != 'tenant' else '<name>'} {exc.message}")
    return problems


def tenants_of(cfg: Any) -> dict[str, TenantConfig]:
    """The workload's ``tenants`` (each a mapping of ``TenantConfig`` fields, as
    ``+workload.tenants.<name>={rate:2,priority:1}`` gives it, or a ``TenantConfig``).
    Raises ``ConfigError`` naming every bad tenant field."""
    known = {f.name for f in dataclasses.fields(TenantConfig)}
    parsed: dict[str, TenantConfig] = {}
    problems: list[str] = []
    for name, node in cfg.tenants.items():
        fields = (dataclasses.asdict(node) if dataclasses.is_dataclass(node)
                  else OmegaConf.to_container(node) if OmegaConf.is_config(node) else node)
        if not isinstance(fields, dict) or set(fields) - known:
            problems.append(f"workload.tenants.{name} must map fields of {', '.join(sorted(known))} to values, "
                            f"got {fields!r}")
            continue
        tenant = TenantConfig(**fields)
        problems += _problems(name, tenant)
        parsed[name] = tenant
    if problems:
        raise ConfigError(problems)
    return parsed


def tenant_rates(cfg: Any, rate: float | None = None) -> dict[str, float]:
    """Each tenant's request rate; ``rate`` (when given) scales them all so that they add
    up to it (a capacity search's total rate). Raises ``ConfigError`` naming every bad
    tenant field."""
    tenants = tenants_of(cfg)
    total = sum(tenant.rate for tenant in tenants.values())
    scale = 1.0 if rate is None else rate / total
    return {name: tenant.rate * scale for name, tenant in tenants.items()}


def tenant_client(cfg: Any, tenants: dict[str, TenantConfig], name: str, rate: float) -> Any:
    """The single-client workload of tenant ``name`` (one of ``tenants``): the workload's
    fields, its own where set, at ``rate``; by default its share of ``num_requests`` by rate."""
    tenant = tenants[name]
    fields = OmegaConf.to_container(OmegaConf.structured(cfg))
    fields.pop("tenants")
    total = sum(t.rate for t in tenants.values())
    fields["num_requests"] = max(1, round(cfg.num_requests * tenant.rate / total))
    fields.update({key: getattr(tenant, key) for key in CLIENT_FIELDS if getattr(tenant, key) is not None})
    fields["rate"] = rate
    return OmegaConf.create(fields)


def build_tenant_workload(cfg: Any, space: Any, rate: float | None = None, prefix: str = "") -> list[Any]:
    """Every tenant's requests (ids ``<prefix><tenant>-<i>``, random streams of their own),
    each carrying ``RequestMetadata(tenant, priority, slo_class)``, sorted by arrival."""
    from servelab.bench.workload import client_requests

    requests = []
    tenants = tenants_of(cfg)
    for name, tenant_rate in tenant_rates(cfg, rate).items():
        tenant = tenants[name]
        metadata = RequestMetadata(priority=tenant.priority, tenant=name, slo_class=tenant.slo_class)
        requests += client_requests(tenant_client(cfg, tenants, name, tenant_rate), space, None, f"{prefix}{name}-",
                                    f"{cfg.seed}:{name}", metadata)
    return sorted(requests, key=lambda r: r.arrival_offset_s)
