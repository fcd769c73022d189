"""servelab's Ray Serve application on a local two-CPU Ray cluster, for the Ray tests."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from server_process import free_port


@contextlib.contextmanager
def local_ray_app(overrides: list[str], model: str) -> Iterator[str]:
    """Start a local Ray cluster and Serve with servelab's application for ``overrides``
    and ``model``; yields the proxy's URL and shuts both down afterwards."""
    import ray
    from ray import serve

    from servelab.server.config import compose_serve_config
    from servelab.server.ray_serve.app import APP_NAME, build_app

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(compose_serve_config(overrides), model), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def openai_client(url: str) -> Iterator[Any]:
    """The official OpenAI client pointed at the Ray Serve proxy at ``url``."""
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
