"""``router=prefix_affinity``: requests that share a prompt prefix go to the same replica,
so its prefix cache hits; load decides when that replica is far busier than the rest."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.router import ReplicaState, Router, RouterContext
from servelab.plugins.router.least_loaded import least_loaded


@dataclass
class PrefixAffinityRouterConfig:
    """``prefix_blocks``: how many of the prompt's first full cache blocks identify its
    prefix; ``max_imbalance``: how many more requests than the least loaded replica the
    prefix's replica may hold before the request goes to the least loaded one instead."""

    prefix_blocks: int = 1
    max_imbalance: int = 8


class PrefixAffinityRouter(Router):
    """Hashes the prompt's first ``prefix_blocks`` blocks to a replica (prompts shorter
    than a block go to the least loaded replica)."""

    def __init__(self, config: PrefixAffinityRouterConfig, context: RouterContext):
        super().__init__(config, context)
        problems = []
        if config.prefix_blocks < 1:
            problems.append(f"router.prefix_blocks must be >= 1, got {config.prefix_blocks}")
        if config.max_imbalance < 0:
            problems.append(f"router.max_imbalance must be >= 0, got {config.max_imbalance}")
        if problems:
            raise ConfigError(problems)

    def route(self, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The prefix's replica unless it is overloaded."""
        fallback = least_loaded(replicas)
        full_blocks = min(self.config.prefix_blocks, len(prompt_token_ids) // self.context.block_size)
        if not full_blocks:
            return fallback
        prefix = prompt_token_ids[:full_blocks * self.context.block_size]
        home = zlib.crc32(",".join(map(str, prefix)).encode()) % len(replicas)
        if replicas[home].load - replicas[fallback].load > self.config.max_imbalance:
            return fallback
        return home


SPEC = ComponentSpec("router", "prefix_affinity", PrefixAffinityRouter, PrefixAffinityRouterConfig,
                     "requests sharing a prompt prefix go to the same replica (prefix cache hits), load permitting")
