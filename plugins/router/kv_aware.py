"""``router=kv_aware``: the replica whose prefix cache holds most of the prompt, load permitting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_cache import KVCacheEvent, apply_cache_events, block_hashes
from servelab.core.router import ReplicaState, Router, RouterContext


@dataclass
class KVAwareRouterConfig:
    """``load_weight``: how many cached prompt tokens outweigh one more request held (running
    or queued) on a replica: each replica scores the prompt tokens its cache holds minus
    ``load_weight`` times its load, and the best score wins (ties: the less loaded, then
    the lower index)."""

    load_weight: float = 64.0


class KVAwareRouter(Router):
    """Routes by what each replica's prefix cache holds, learned from its cache events (the
    chained hashes of the blocks it stored and evicted): the prompt's leading full blocks
    are hashed the same way and matched against each replica's blocks, in order, as that
    replica's lookup would match them."""

    uses_cache_events = True

    def __init__(self, config: KVAwareRouterConfig, context: RouterContext):
        if not config.load_weight >= 0:
            raise ConfigError([f"router.load_weight must be >= 0, got {config.load_weight}"])
        super().__init__(config, context)
        self.cached: list[set[int]] = [set() for _ in range(context.num_replicas)]

    def on_cache_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """Add stored blocks to the replica's set, drop evicted ones; a snapshot replaces it."""
        apply_cache_events(self.cached[replica], events)

    def matched_tokens(self, prompt_token_ids: Sequence[int], replica: int) -> int:
        """Prompt tokens in the replica's cache: its leading full blocks, up to the first
        the replica does not hold (at most all but the last token, as a lookup leaves it)."""
        size = self.context.block_size
        held = self.cached[replica]
        matched = 0
        for digest in block_hashes(prompt_token_ids, size, (len(prompt_token_ids) - 1) // size):
            if digest not in held:
                break
            matched += size
        return matched

    def route(self, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The replica of the best score, cached tokens minus weighted load."""
        weight = self.config.load_weight

        def score(replica: ReplicaState) -> tuple[float, int, int]:
            cached = self.matched_tokens(prompt_token_ids, replica.index)
            return cached - weight * replica.load, -replica.load, -replica.index

        return max(replicas, key=score).index


SPEC = ComponentSpec("router", "kv_aware", KVAwareRouter, KVAwareRouterConfig,
                     "the replica whose prefix cache holds most of the prompt (from its cache events), load permitting")
