"""One measurement: pick the system under test, build the workload, run it, summarize."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from servelab.bench.config import (HttpTargetConfig, InprocTargetConfig, NoBaselineConfig,
                                   TransformersBaselineConfig, VllmBaselineConfig)
from servelab.bench.metrics import RequestRecord, summarize
from servelab.bench.sessions import build_sessions, is_closed_loop
from servelab.bench.system import System
from servelab.bench.tenant_metrics import slo_class_summary, tenant_summary
from servelab.bench.tenants import tenant_rates
from servelab.bench.workload import BenchRequest, build_workload, warmup_workload
from servelab.core.deployment import is_disaggregated
from servelab.core.errors import ConfigError
from servelab.core.policy import SLOClass


def open_system(cfg: DictConfig, folder: str) -> System:
    """The system ``cfg`` selects: a baseline engine, else servelab through ``target``.
    ``folder`` is where a system may write files (the job's output folder)."""
    baseline = OmegaConf.get_type(cfg.baseline)
    target = OmegaConf.get_type(cfg.target)
    if baseline is not NoBaselineConfig and target is not InprocTargetConfig:
        raise ConfigError([f"baseline={'vllm' if baseline is VllmBaselineConfig else 'transformers'} runs in this "
                           f"process: use target=inproc (measure a remote server with baseline=none target=http)"])
    if baseline is not NoBaselineConfig and is_disaggregated(cfg):
        raise ConfigError([f"baseline={'vllm' if baseline is VllmBaselineConfig else 'transformers'} runs one engine: "
                           f"use deployment=single (deployment=disaggregated measures servelab's pools)"])
    if baseline is TransformersBaselineConfig:
        from servelab.bench.baselines.hf_generate import TransformersSystem

        return TransformersSystem(cfg)
    if baseline is VllmBaselineConfig:
        from servelab.bench.baselines.vllm_engine import VllmSystem

        return VllmSystem(cfg, folder)
    if target is HttpTargetConfig:
        from servelab.bench.targets.http import HttpSystem

        return HttpSystem(cfg)
    if is_disaggregated(cfg):
        from servelab.bench.targets.disaggregated import DisaggregatedSystem
        from servelab.core.entrypoints.compose import app_overrides

        return DisaggregatedSystem(cfg, app_overrides())
    if cfg.target.replicas != 1:
        from servelab.bench.targets.cluster import ClusterSystem

        return ClusterSystem(cfg)
    from servelab.bench.targets.inproc import ServelabSystem

    return ServelabSystem(cfg)


def offered_rate(workload: Any, requests: list, rate: float | None) -> float | None:
    """Requests per second offered: the tenants' total rate when there are tenants, None
    when requests arrive all at once, the trace's own mean rate for a trace replayed as
    recorded, else the configured (or searched) rate."""
    if workload.tenants:
        return sum(tenant_rates(workload, rate).values())
    if workload.arrival == "all_at_once":
        return None
    if workload.arrival == "trace" and rate is None and workload.trace_rate is None:
        span = requests[-1].arrival_offset_s if requests else 0.0
        return (len(requests) - 1) / span if span > 0 else None
    return rate if rate is not None else (workload.trace_rate if workload.arrival == "trace" else workload.rate)


def with_metadata(records: list[RequestRecord], requests: list[BenchRequest]) -> list[RequestRecord]:
    """``records`` with the tenant, priority and SLO class of the request each answers."""
    metadata = {r.request_id: r.metadata for r in requests if r.metadata is not None}
    return [replace(record, tenant=m.tenant, priority=m.priority, slo_class=m.slo_class)
            if (m := metadata.get(record.request_id)) is not None else record for record in records]


def measure(system: System, cfg: DictConfig, rate: float | None = None, desc: str = "requests") -> dict[str, Any]:
    """Warm up, then run the workload (at ``rate`` requests/s when given) and return its
    metrics: the client-side summary, the system's statistics under ``system``, the
    workload's description, ``sessions`` for a closed-loop workload (first vs later
    requests: ``Sessions.summary``), and ``samples`` (per-request TTFT/TPOT/E2E and every gap, ms)."""
    from tqdm.auto import tqdm

    workload = cfg.workload
    sessions = build_sessions(workload, system.space, rate) if is_closed_loop(workload) else None
    if sessions is not None and not system.closed_loop:
        raise ConfigError([f"workload.{sessions.kind} is closed-loop: run it on target=inproc with one replica, "
                           f"target=http or a baseline (system {system.name} sends open loop only)"])
    requests = sessions.requests if sessions is not None else build_workload(workload, system.space, rate=rate)
    if cfg.warmup_requests > 0:
        system.run(warmup_workload(system.space, cfg.warmup_requests))
    with tqdm(total=None if sessions else len(requests), desc=desc, unit="req", disable=not cfg.use_tqdm,
              dynamic_ncols=True) as bar:
        records, stats = (system.run(requests, bar, follow_up=sessions.follow_up) if sessions is not None
                          else system.run(requests, bar))
    metrics = summarize(records, cfg.slo)
    if sessions is not None:
        metrics["sessions"] = sessions.summary(records)
    if workload.tenants:
        records = with_metadata(records, requests)
        metrics.update(tenant_summary(records))
        classes, _ = SLOClass.parse(OmegaConf.to_container(cfg.slo_classes))
        metrics.update(slo_class_summary(records, classes, metrics["duration_s"]))
    metrics["system"] = {"name": system.name, **stats}
    metrics["workload"] = {"arrival": workload.arrival, "rate": offered_rate(workload, requests, rate),
                           "tenants": tenant_rates(workload, rate) if workload.tenants else None,
                           "burstiness": workload.burstiness, "lengths": workload.lengths,
                           "prefix_len": workload.prefix_len, "seed": workload.seed}
    metrics["samples"] = {
        "ttft_ms": [1000 * r.ttft for r in records if r.ok],
        "tpot_ms": [1000 * t for r in records if r.ok and (t := r.tpot) is not None],
        "e2e_ms": [1000 * r.e2e for r in records if r.ok],
        "itl_ms": [1000 * gap for r in records if r.ok for gap in r.itls],
    }
    return metrics
