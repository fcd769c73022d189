"""Console entry point ``servelab-serve``: the OpenAI-compatible server as a Hydra app."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from servelab.core.entrypoints.compose import prepare_hydra
from servelab.server.config import store_serve_schema

GRACEFUL_SHUTDOWN_TIMEOUT_S = 5
"""After draining, how long uvicorn waits for connections to close."""


def serve(cfg: DictConfig) -> None:
    """Start the engine processes of ``cfg``'s deployment and serve them on
    ``server.host:server.port`` until SIGTERM/SIGINT (``server.backend=ray``: replicas on
    Ray Serve, ``ray_serve.app``); configuration errors exit with status 2, an engine
    failure with 1."""
    from servelab.core.deployment import is_disaggregated
    from servelab.core.entrypoints.compose import app_overrides
    from servelab.core.errors import ConfigError
    from servelab.server.config import server_problems, served_model_name
    from servelab.server.deployment import deployment_service, plan_instances
    from servelab.server.engine_process import EngineProcess

    server_cfg = cfg.server
    try:
        problems = server_problems(server_cfg)
        if problems:
            raise ConfigError(problems)
        if server_cfg.backend == "ray" and is_disaggregated(cfg):
            serve_instances_on_ray(cfg)
        elif server_cfg.backend == "ray":
            from servelab.server.ray_serve.app import serve_on_ray

            serve_on_ray(cfg, served_model_name(cfg))
        else:
            with deployment_service(cfg):
                plans = plan_instances(cfg, app_overrides())
                run_server(cfg, plans, EngineProcess.launch_all(plans, server_cfg))
    except ConfigError as exc:
        print(f"servelab-serve: error: {exc}", file=sys.stderr)
        sys.exit(2)


def serve_instances_on_ray(cfg: DictConfig) -> None:
    """``server.backend=ray deployment=disaggregated``: every instance an engine actor on
    the Ray cluster this machine belongs to (or a local one), placed by its pool's
    ``ray_resources``, behind this process's HTTP server."""
    import dataclasses

    import ray

    from servelab.core.entrypoints.compose import app_overrides
    from servelab.server.deployment import deployment_service, plan_instances
    from servelab.server.ray_serve.remote_engine import launch_on_ray

    ray.init()
    try:
        with deployment_service(cfg):
            plans = [dataclasses.replace(plan, cores=None, threads=cfg.deployment[plan.cfg.role].engine_threads or
                                         max(1, int(cfg.server.replica_cpus)))
                     for plan in plan_instances(cfg, app_overrides())]
            run_server(cfg, plans, launch_on_ray(plans, cfg))
    finally:
        ray.shutdown()


def run_server(cfg: DictConfig, plans: list, processes: list) -> None:
    """Serve the started engine processes on ``server.host:server.port`` until
    SIGTERM/SIGINT; an engine failure exits with status 1."""
    import uvicorn

    from servelab.server.app import create_app
    from servelab.server.async_engine import AsyncEngine
    from servelab.server.config import served_model_name
    from servelab.server.draining_server import DrainingServer
    from servelab.server.metrics import ServerMetrics
    from servelab.server.state import ServerState

    server_cfg = cfg.server
    prefill = [p for plan, p in zip(plans, processes) if plan.cfg.role != "decode"]
    decode = [p for plan, p in zip(plans, processes) if plan.cfg.role == "decode"]
    info = processes[0].info
    metrics = ServerMetrics(info.prefix_caching, any(p.info.speculative for p in processes),
                            server_cfg.max_tenant_labels, info.slo_classes, info.lora_enabled)
    engine = AsyncEngine(prefill, metrics, server_cfg.max_queued_requests, server_cfg.request_timeout_s, decode,
                         pool_routers(cfg, len(prefill), len(decode), info.block_size))
    state = ServerState(engine, server_cfg, served_model_name(cfg))
    config = uvicorn.Config(create_app(state), host=server_cfg.host, port=server_cfg.port,
                            log_level=server_cfg.log_level, access_log=server_cfg.access_log, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S)
    server = DrainingServer(config, state)
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)


def pool_routers(cfg: DictConfig, num_prefill: int, num_decode: int, block_size: int) -> dict:
    """The ``router`` plugin built for each pool of more than one instance."""
    from servelab.core.engine.registry import get_registry
    from servelab.core.router import RouterContext

    registry = get_registry()
    return {pool: registry.build("router", cfg.router, RouterContext(count, block_size))
            for pool, count in (("prefill", num_prefill), ("decode", num_decode)) if count > 1}


def main() -> None:
    """``servelab-serve [overrides...]``: Hydra app over ``conf/serve.yaml``."""
    import hydra

    prepare_hydra()
    store_serve_schema()
    hydra.main(config_path="pkg://servelab.conf", config_name="serve", version_base=None)(serve)()
