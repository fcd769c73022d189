"""Console entry point ``servelab-serve``: the OpenAI-compatible server as a Hydra app."""

from __future__ import annotations

import os
import sys

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
"""The engine thread shares the cores with the event loop; OpenMP workers that spin for
about a millisecond between parallel regions starve it (26m model, bfloat16, 11 req/s on
two cores: P99 TPOT 134 ms with the default spin, 43-49 ms with this one). OpenMP reads
these when torch loads it, so they are set here, before any import of torch; values
already in the environment win."""
for _name, _value in OPENMP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

from omegaconf import DictConfig  # noqa: E402

from servelab.core.compose import prepare_hydra  # noqa: E402
from servelab.server.config import store_serve_schema  # noqa: E402

GRACEFUL_SHUTDOWN_TIMEOUT_S = 5
"""After draining, how long uvicorn waits for connections to close."""


def serve(cfg: DictConfig) -> None:
    """Build the engine from ``cfg`` and serve it on ``server.host:server.port`` until
    SIGTERM/SIGINT; configuration errors exit with status 2."""
    import uvicorn

    from servelab.core.engine import LLMEngine
    from servelab.core.errors import ConfigError
    from servelab.server.app import ServerState, create_app
    from servelab.server.async_engine import AsyncEngine
    from servelab.server.config import served_model_name
    from servelab.server.draining_server import DrainingServer
    from servelab.server.metrics import ServerMetrics

    try:
        engine = LLMEngine(cfg)
    except ConfigError as exc:
        print(f"servelab-serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    server_cfg = cfg.server
    state = ServerState(AsyncEngine(engine, ServerMetrics(engine)), server_cfg, served_model_name(cfg))
    config = uvicorn.Config(create_app(state), host=server_cfg.host, port=server_cfg.port,
                            log_level=server_cfg.log_level, access_log=server_cfg.access_log, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT_S)
    DrainingServer(config, state).run()


def main() -> None:
    """``servelab-serve [overrides...]``: Hydra app over ``conf/serve.yaml``."""
    import hydra

    prepare_hydra()
    store_serve_schema()
    hydra.main(config_path="pkg://servelab.conf", config_name="serve", version_base=None)(serve)()
