"""A Ray Serve request router that asks a servelab router plugin which replica to use.

With ``server.routing=router`` the engine deployment routes with this class: the
``router=`` plugin the simulator uses (``round_robin``, ``least_loaded``,
``prefix_affinity``, a third party's) picks the replica of each request, from the
prompt tokens the ingress put in the ``ForwardedRequest`` and what each replica last
reported of itself (``EngineReplica.record_routing_stats``; for ``router=kv_aware`` the
blocks its prefix cache holds, handed to the plugin as a ``held`` cache event). Replicas are indexed in
the order of their ids, so a prefix keeps its replica while the set of replicas does.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from servelab.core.kv_cache import KVCacheEvent
from servelab.core.router import ReplicaState, RouterContext


class PluginRequestRouter(RequestRouter):
    """Ranks the plugin's replica first and every other replica second, so a request
    whose replica is full (Ray Serve's ``max_ongoing_requests``) goes elsewhere rather
    than wait. Requests without a prompt (``/health``, ``/tokenize``, ...) may go to any
    replica; Ray Serve takes the one with the shortest queue."""

    def initialize_state(self, router: str, options: dict[str, Any], num_replicas: int, block_size: int) -> None:
        """Build the router plugin ``router`` with ``options`` (its config fields)."""
        from servelab.core.engine.registry import get_registry

        spec = get_registry().get("router", router)
        self.plugin = spec.cls(spec.config_cls(**options), RouterContext(num_replicas, block_size))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        """The plugin's choice first, then the rest."""
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        prompt = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait before the next try
            if pending_request.args:
                prompt = getattr(pending_request.args[0], "prompt_token_ids", None)
        if not replicas or prompt is None:
            return [replicas]
        states = [ReplicaState(i, r.routing_stats.get("num_running", 0), r.routing_stats.get("num_waiting", 0),
                               r.routing_stats.get("kv_usage", 0.0)) for i, r in enumerate(replicas)]
        if self.plugin.uses_cache_events:  # each replica's latest snapshot of its prefix cache
            for i, replica in enumerate(replicas):
                held = tuple(replica.routing_stats.get("cached_blocks", ()))
                self.plugin.on_cache_events(i, [KVCacheEvent("held", held)])
        chosen = replicas[self.plugin.route(prompt, states)]
        return [[chosen], [r for r in replicas if r is not chosen]]
