"""``servelab-serve server.backend=ray``: ``server.replicas`` engine replicas behind Ray
Serve's HTTP proxy, with the OpenAI endpoints of the local server (docs/parallel.md).

``build_app(cfg, model_name)`` is the Ray Serve application (the Python entry point:
``serve.run(build_app(cfg, "toy"), route_prefix="/")``); ``serve_on_ray`` joins the Ray
cluster this machine belongs to (``ray start``), or starts a local one, runs the
application until SIGTERM/SIGINT, then shuts it down (each replica drains first).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from omegaconf import DictConfig, OmegaConf

from servelab.core.errors import ConfigError

log = logging.getLogger(__name__)

APP_NAME = "servelab"

MAX_ONGOING_REQUESTS = 1024
"""HTTP requests Ray Serve sends one replica (or the ingress) at once; more wait in Ray
Serve's queue. The engine's scheduler does the real admission, so this is high."""

ENGINE_STOP_MARGIN_S = 30.0
"""Ray Serve's graceful shutdown allows ``server.drain_timeout_s`` plus this, for the
engine process to stop."""

ROUTING_STATS_PERIOD_S = 1.0
"""How often each replica reports its load to a servelab router (``server.routing=router``)."""

CONFIG_ERROR_PHRASE = "invalid servelab configuration:"
"""How a ``ConfigError`` begins (``servelab.core.errors``)."""

UNBLOCKED_PREFIX_TOKENS = 16
"""The prefix unit a servelab router gets for a cache without blocks (``cache=contiguous``)."""


def router_options(cfg: DictConfig) -> dict[str, Any]:
    """``PluginRequestRouter``'s keyword arguments (JSON, as Ray Serve requires): the
    ``router=`` plugin's name and fields, the replica count and the cache's block size.
    Raises ``ConfigError`` when the router refuses its config."""
    from servelab.core.engine.registry import get_registry
    from servelab.core.router import RouterContext

    registry = get_registry()
    block_size = OmegaConf.select(cfg, "cache.block_size") or UNBLOCKED_PREFIX_TOKENS
    registry.build("router", cfg.router, RouterContext(cfg.server.replicas, block_size))  # its config errors, now
    return {"router": registry.spec_for_config("router", cfg.router).name,
            "options": OmegaConf.to_container(cfg.router, resolve=True),
            "num_replicas": cfg.server.replicas, "block_size": block_size}


def routing_problems(cfg: DictConfig) -> list[str]:
    """What keeps a router that reads cache events (``router=kv_aware``) from routing:
    Ray Serve choosing the replicas instead, or replicas without a prefix cache."""
    from servelab.core.engine.registry import get_registry

    spec = get_registry().spec_for_config("router", cfg.router)
    if not spec.cls.uses_cache_events:
        return []
    name, problems = spec.name, []
    if cfg.server.routing != "router":
        problems.append(f"router={name} needs server.routing=router (server.routing={cfg.server.routing} lets "
                        f"Ray Serve pick the replicas)")
    if not OmegaConf.select(cfg, "cache.enable_prefix_caching", default=False):
        problems.append(f"router={name} routes by what the replicas' prefix caches hold: set "
                        f"cache.enable_prefix_caching=true (cache=paged)")
    return problems


def build_app(cfg: DictConfig, model_name: str) -> Any:
    """The Ray Serve application: ``ServelabIngress`` over ``server.replicas`` replicas of
    ``EngineReplica``, each reserving ``server.replica_cpus`` CPUs and
    ``server.replica_gpus`` GPUs, routed by Ray Serve or by the ``router=`` plugin.
    Raises ``ConfigError`` for the ``routing_problems``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from servelab.core.config import resolved
    from servelab.server.ray_serve.ingress import ServelabIngress
    from servelab.server.ray_serve.replica import EngineReplica
    from servelab.server.ray_serve.request_router import PluginRequestRouter

    problems = routing_problems(cfg)
    if problems:
        raise ConfigError(problems)
    server = cfg.server
    options: dict[str, Any] = {}
    if server.routing == "router":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PluginRequestRouter, request_router_kwargs=router_options(cfg),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    plain = resolved(cfg)
    replicas = serve.deployment(EngineReplica).options(
        name="EngineReplica", num_replicas=server.replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": server.replica_cpus, "num_gpus": server.replica_gpus},
        graceful_shutdown_timeout_s=server.drain_timeout_s + ENGINE_STOP_MARGIN_S, **options,
    ).bind(plain, model_name)
    ingress = serve.deployment(ServelabIngress).options(
        name="ServelabIngress", num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, plain)


def config_problems(message: str) -> list[str]:
    """The problems of the first ``ConfigError`` quoted in ``message`` (a traceback)."""
    start = message.find(CONFIG_ERROR_PHRASE)
    if start < 0:
        return []
    problems = []
    for line in message[start + len(CONFIG_ERROR_PHRASE):].strip().splitlines():
        if not line.strip().startswith("- "):
            break
        problems.append(line.strip()[2:])
    return problems


def deploy_failures() -> list[str]:
    """Why the application's deployments failed, as Ray Serve recorded it: the problems
    of a replica's ``ConfigError`` (the engine refused its configuration)."""
    from ray import serve

    application = serve.status().applications.get(APP_NAME)
    deployments = application.deployments.values() if application else ()
    return [problem for d in deployments for problem in config_problems(d.message or "")]


def serve_on_ray(cfg: DictConfig, model_name: str) -> None:
    """Deploy ``build_app`` on the Ray cluster, with Ray Serve's HTTP proxy on
    ``server.host:server.port``; serve until SIGTERM/SIGINT, then shut down. Raises
    ``ConfigError`` for a bad configuration (the replicas' engines included)."""
    import ray
    from ray import serve

    app = build_app(cfg, model_name)
    ray.init()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise ConfigError([f"the Ray Serve application failed to deploy: {exc}", *deploy_failures()]) from exc
        log.info("serving %d replicas on http://%s:%d", cfg.server.replicas, cfg.server.host, cfg.server.port)
        stop.wait()
        log.info("stopping: the replicas drain (up to %.1fs)", cfg.server.drain_timeout_s)
    finally:
        serve.shutdown()
        ray.shutdown()
