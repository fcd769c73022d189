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
    the lower index). ``tier_weight``: what a cached token below the device (in a host or
    lower tier: loaded back, not recomputed) counts for against one on the device."""

    load_weight: float = 64.0
    tier_weight: float = 0.5


class KVAwareRouter(Router):
    """Routes by what each replica's prefix cache holds, learned from its cache events (the
    chained hashes of the blocks it stored, moved to a tier below the device and
    evicted): the prompt's leading full blocks are hashed the same way and matched against
    each replica's blocks, in order, as that replica's lookup would match them, those
    below the device counting ``tier_weight`` each."""

    uses_cache_events = True

    def __init__(self, config: KVAwareRouterConfig, context: RouterContext):
        problems = [f"router.{name} must be >= 0, got {value}" for name, value in
                    (("load_weight", config.load_weight), ("tier_weight", config.tier_weight)) if not value >= 0]
        if problems:
            raise ConfigError(problems)
        super().__init__(config, context)
        self.cached: list[set[int]] = [set() for _ in range(context.num_replicas)]
        self.below: list[set[int]] = [set() for _ in range(context.num_replicas)]

    def on_cache_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """Add stored blocks to the replica's set, note moved ones as below the device, drop
        evicted ones; a snapshot replaces it."""
        apply_cache_events(self.cached[replica], events, self.below[replica])

    def matched_tokens(self, prompt_token_ids: Sequence[int], replica: int) -> float:
        """Prompt tokens in the replica's cache, those below the device weighted by
        ``tier_weight``: its leading full blocks, up to the first the replica does not hold
        (at most all but the last token, as a lookup leaves it)."""
        size = self.context.block_size
        held, below, weight = self.cached[replica], self.below[replica], self.config.tier_weight
        matched = 0.0
        for digest in block_hashes(prompt_token_ids, size, (len(prompt_token_ids) - 1) // size):
            if digest not in held:
                break
            matched += size * weight if digest in below else size
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
