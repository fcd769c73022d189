"""The ``servelab-serve`` config schema: the engine groups of ``servelab`` plus ``server``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from servelab.core.config import EngineConfig
from servelab.server.metrics import DEFAULT_MAX_TENANT_LABELS


@dataclass
class ServerConfig:
    """The HTTP side of ``servelab-serve``.

    ``host``/``port``: where to listen. ``api_key``: when set, ``/v1/*``, ``/tokenize`` and
    ``/detokenize`` require ``Authorization: Bearer <api_key>`` (conf/serve.yaml reads it
    from ``$SERVELAB_API_KEY``). ``served_model_name``: the ``model`` clients must send
    (default: the model preset or folder). ``drain_timeout_s``: on SIGTERM, how long
    in-flight requests may run before they are aborted. ``log_level``/``access_log``:
    uvicorn logging. The engine runs in its own process: ``engine_threads`` is its number
    of compute threads (default: every core the server may use) and ``engine_nice`` how
    much lower its scheduling priority is than the HTTP side's (a Unix nice increment,
    0-19), so that a streamed token or a new request is handled as soon as it arrives
    instead of after the engine's threads give up a core;
    ``warmup_tokens``: before listening, it packs the weights and compiles the CPU matmul
    kernels of steps up to this many tokens (default: the scheduler's step budget, which
    covers every step; 0: skip; larger steps compile on first use).

    Backpressure (docs/server.md): ``max_queued_requests`` bounds the engine requests
    (one per prompt of an API call) the server holds accepted and not finished, waiting
    or running; past it, new completion calls get 429 with ``Retry-After`` (null:
    unbounded). ``request_timeout_s``: a call still running this many seconds after it
    was accepted is aborted in the engine, which frees its KV blocks, and answered 504
    (a stream ends with an error event); null: no limit.

    Metrics (docs/server.md): ``max_tenant_labels`` bounds the ``tenant`` label of the
    request metrics: the first this many distinct tenants (a request's ``user`` or
    ``X-Servelab-Tenant``) get their own value, later ones are counted as ``other``; a
    request naming none is ``default``.

    ``backend``: ``local`` (one engine process behind this process's HTTP server) or
    ``ray`` (``replicas`` engine replicas behind Ray Serve's HTTP proxy, docs/parallel.md);
    on ``ray``, ``routing`` is ``ray`` (Ray Serve's own choice) or ``router`` (the
    ``router=`` plugin, e.g. ``router=prefix_affinity``), and each replica reserves
    ``replica_cpus`` CPUs and ``replica_gpus`` GPUs of the cluster.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    access_log: bool = True
    engine_threads: Optional[int] = None
    engine_nice: int = 5
    warmup_tokens: Optional[int] = None
    max_queued_requests: Optional[int] = 1024
    request_timeout_s: Optional[float] = None
    max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS
    backend: str = "local"
    replicas: int = 1
    routing: str = "ray"
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0


BACKENDS = ("local", "ray")
ROUTINGS = ("ray", "router")


def server_problems(server: ServerConfig) -> list[str]:
    """Every problem of the ``server`` node's backend, backpressure and metrics settings,
    each naming its field."""
    problems = []
    if server.backend not in BACKENDS:
        problems.append(f"server.backend must be one of {', '.join(BACKENDS)}, got {server.backend!r}")
    if server.replicas < 1:
        problems.append(f"server.replicas must be >= 1, got {server.replicas}")
    elif server.replicas > 1 and server.backend == "local":
        problems.append(f"server.replicas={server.replicas} needs server.backend=ray (backend local serves one engine)")
    if server.routing not in ROUTINGS:
        problems.append(f"server.routing must be one of {', '.join(ROUTINGS)}, got {server.routing!r}")
    if server.replica_cpus < 0 or server.replica_gpus < 0:
        problems.append(f"server.replica_cpus and server.replica_gpus must be >= 0, got {server.replica_cpus} "
                        f"and {server.replica_gpus}")
    limit = server.max_queued_requests
    if limit is not None and limit < 1:
        problems.append(f"server.max_queued_requests must be at least 1 (or null for no limit), got {limit}")
    timeout = server.request_timeout_s
    if timeout is not None and not timeout > 0:
        problems.append(f"server.request_timeout_s must be more than 0 seconds (or null for no limit), got {timeout}")
    if server.max_tenant_labels < 0:
        problems.append(f"server.max_tenant_labels must be >= 0 (0: every named tenant is labelled other), "
                        f"got {server.max_tenant_labels}")
    return problems


@dataclass
class ServeConfig(EngineConfig):
    """The ``servelab-serve`` app: the engine components, the ``deployment`` of engine
    instances (``single`` or ``disaggregated``) and ``server``."""

    deployment: Any = MISSING
    server: ServerConfig = field(default_factory=ServerConfig)


def store_serve_schema() -> None:
    """Register ``servelab_serve_schema`` (used by conf/serve.yaml) in Hydra's ConfigStore."""
    ConfigStore.instance().store(name="servelab_serve_schema", node=ServeConfig)


def compose_serve_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose ``conf/serve.yaml`` with Hydra overrides, outside a running Hydra app."""
    from servelab.core.entrypoints.compose import compose_config

    store_serve_schema()
    return compose_config(overrides, config_name="serve")


def served_model_name(cfg: DictConfig) -> str:
    """The model name the API answers to: ``server.served_model_name``, else the model
    preset chosen on the command line (``toy``), else the model folder."""
    if cfg.server.served_model_name:
        return cfg.server.served_model_name
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("model")
        if choice and choice != "local":
            return choice
    return cfg.model.path or "servelab"
