"""An engine replica of ``servelab-serve server.backend=ray``: a Ray Serve deployment that
owns one engine, with its own KV cache, and serves the servelab app over it.

The replica is what ``servelab-serve`` is on one machine: an ``EngineProcess`` (the
engine in a process of its own, for the reasons docs/server.md gives: the replica's
event loop and Ray's threads would otherwise take the interpreter lock and the cores the
engine's steps need), an ``AsyncEngine`` and ``ServerMetrics`` over it, and the FastAPI
app of ``app.create_app``, whose lifespan runs with the replica: started by its
constructor, drained and stopped by its destructor, which Ray Serve awaits on shutdown.
Requests arrive from the ingress as ``ForwardedRequest``s and run through that app
in-process (a Ray Serve application has one HTTP ingress: ``ServelabIngress``).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from omegaconf import DictConfig
from ray import serve

from servelab.server.ray_serve.forwarded_request import ForwardedRequest, Message, replay


class EngineReplica:
    """One engine and the servelab app over it. ``cfg``: the resolved ``servelab-serve``
    configuration; ``model_name``: the name requests must give."""

    async def __init__(self, cfg: DictConfig, model_name: str):
        from servelab.server.app import create_app
        from servelab.server.state import ServerState
        from servelab.server.async_engine import AsyncEngine
        from servelab.server.engine_process import EngineProcess
        from servelab.server.metrics import ServerMetrics

        server = cfg.server
        threads = server.engine_threads or max(1, int(server.replica_cpus))
        process = await asyncio.to_thread(EngineProcess.launch, cfg, threads)
        metrics = ServerMetrics(process.info.prefix_caching, process.info.speculative, server.max_tenant_labels,
                                process.info.slo_classes)
        engine = AsyncEngine(process, metrics, server.max_queued_requests, server.request_timeout_s)
        self.state = ServerState(engine, server, model_name)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.reports = 0
        """Routing statistics reported so far: tells a router a new snapshot of the cache."""
        self.app = create_app(self.state)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

    async def __del__(self) -> None:
        """Drain (``server.drain_timeout_s``) and stop the engine process."""
        await self._lifespan.__aexit__(None, None, None)

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """Run one forwarded request through the app; stream its ASGI messages."""
        async for message in replay(self.app, request):
            yield message

    def metrics_text(self) -> tuple[str, bytes]:
        """This replica's id and its Prometheus exposition."""
        return self.replica_id, self.state.engine.metrics.render()

    def record_routing_stats(self) -> dict[str, Any]:
        """What a servelab router sees of this replica (Ray Serve polls it): its KV cache
        usage after the engine's latest step, the number of this report and, under
        ``router=kv_aware``, the chained hashes of the blocks its prefix cache holds."""
        engine = self.state.engine
        self.reports += 1
        usage = engine.metrics.registry.get_sample_value("servelab:kv_cache_usage_perc")
        return {"kv_usage": usage or 0.0, "report": self.reports,
                "cached_blocks": sorted(engine.instances[0].cached_blocks)}

    def check_health(self) -> None:
        """Ray Serve's health check: fails once the engine loop failed or its process
        died, so Ray Serve replaces this replica."""
        if self.state.engine.dead is not None:
            raise RuntimeError(f"the engine failed: {self.state.engine.dead}")
