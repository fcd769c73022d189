"""A Ray Serve request router that asks a servelab router plugin which replica to use.

With ``server.routing=router`` the engine deployment routes with this class: the
``router=`` plugin the simulator uses (``round_robin``, ``least_loaded``,
``prefix_affinity``, ``kv_aware``, a third party's) picks the replica of each request,
from the prompt tokens the ingress put in the ``ForwardedRequest``, the requests this
router sent each replica and has not seen finish, and what each replica last reported of
itself (``EngineReplica.record_routing_stats``: its KV cache usage and, for
``router=kv_aware``, the blocks its prefix cache holds, handed to the plugin as a
``held`` cache event). Between two reports of a replica, the plugin also counts the full
blocks of the prompts routed to it as stored, so that requests sent together with a new
common prefix find it. Replicas are indexed in the order of their ids, so a prefix keeps
its replica while the set of replicas does.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from servelab.core.kv_cache import KVCacheEvent, block_hashes
from servelab.core.router import ReplicaState, RouterContext

if TYPE_CHECKING:
    from ray.serve._private.common import ReplicaID


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
        self.in_flight: collections.Counter[ReplicaID] = collections.Counter()
        """Requests sent to each replica and not finished: the load the plugin sees, exact
        where the replicas' own reports are up to a stats period old."""
        self.snapshots: dict[int, tuple[str, Any]] = {}
        """Per plugin index, the replica and report whose cache snapshot the plugin holds."""

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Count a request Ray Serve sends ``replica_id``."""
        super().on_send_request(replica_id)
        self.in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request sent to ``replica_id`` finished, failed or was refused."""
        self.in_flight[replica_id] -= 1
        if self.in_flight[replica_id] <= 0:
            del self.in_flight[replica_id]

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
        states = [ReplicaState(i, self.in_flight[r.replica_id], 0, r.routing_stats.get("kv_usage", 0.0))
                  for i, r in enumerate(replicas)]
        if self.plugin.uses_cache_events:
            self._apply_snapshots(replicas)
        index = self.plugin.route(prompt, states)
        if self.plugin.uses_cache_events:
            size = self.plugin.context.block_size
            expected = block_hashes(prompt, size, (len(prompt) - 1) // size)
            self.plugin.on_cache_events(index, [KVCacheEvent("stored", tuple(expected))])
        chosen = replicas[index]
        return [[chosen], [r for r in replicas if r is not chosen]]

    def _apply_snapshots(self, replicas: List[RunningReplica]) -> None:
        """Hand the plugin each replica's latest snapshot of its prefix cache, once per
        report (a snapshot replaces the blocks expected since the one before)."""
        for i, replica in enumerate(replicas):
            stats = replica.routing_stats
            snapshot = (replica.replica_id.unique_id, stats.get("report"))
            if self.snapshots.get(i) != snapshot:
                self.snapshots[i] = snapshot
                self.plugin.on_cache_events(i, [KVCacheEvent("held", tuple(stats.get("cached_blocks", ())))])
