"""Token-tree speculation under ``executor=simulated``: the per-depth, per-rank acceptance
model (``executor.tree_acceptance``) that draws the path a tree keeps, and the tree shape a
speculative strategy's config verifies (its nodes are the step's lookahead tokens, priced
as such by the cost model; its levels are the draft model's passes).
"""

from __future__ import annotations

import math
from random import Random
from typing import Sequence

from servelab.core.errors import ConfigError


class TreeAcceptance:
    """The acceptance model of ``executor.tree_acceptance``: ``table[d][r]`` the chance
    that the target's token after a kept path of depth d is the rank-r draft there."""

    def __init__(self, table: Sequence[Sequence[float]], name: str = "executor.tree_acceptance"):
        problems = [] if table else [f"{name} must list at least one depth, e.g. [[0.6, 0.15], [0.5, 0.1]]"]
        for depth, row in enumerate(table):
            if any(not 0.0 <= p <= 1.0 for p in row) or sum(row) > 1.0 + 1e-9:
                problems.append(f"{name}[{depth}] = {list(row)}: each chance must be in [0, 1] and a depth's "
                                f"chances sum to at most 1 (the target's token is one rank or none)")
        if problems:
            raise ConfigError(problems)
        self.table = [list(map(float, row)) for row in table]

    def chance(self, depth: int, rank: int) -> float:
        """``table[depth][rank]`` (the last row past the table's depth, 0 past a row's end)."""
        row = self.table[min(depth, len(self.table) - 1)]
        return row[rank] if rank < len(row) else 0.0

    def draw(self, paths: set[tuple[int, ...]], random: Random) -> int:
        """Drafts kept from a tree given as its nodes' rank paths: one draw per depth picks
        the target's rank; the path goes on while that child is in the tree."""
        path: tuple[int, ...] = ()
        while True:
            u, rank, cumulative = random.random(), 0, 0.0
            row = self.table[min(len(path), len(self.table) - 1)]
            while rank < len(row) and u >= cumulative + row[rank]:
                cumulative += row[rank]
                rank += 1
            if rank == len(row) or (*path, rank) not in paths:
                return len(path)
            path = (*path, rank)

    def expected_kept(self, paths: Sequence[tuple[int, ...]]) -> float:
        """The mean of ``draw`` for a tree: sum over its nodes of the chance of their path."""
        return sum(math.prod(self.chance(d, r) for d, r in enumerate(p)) for p in paths)


def tree_shape(config, acceptance: TreeAcceptance) -> tuple[list[tuple[int, ...]], list[int]] | None:
    """The token tree a speculative strategy's ``config`` verifies, as rank paths in an order
    whose every prefix is a tree (cut there to a request's allowance), and the rows of each
    draft-model pass; None for a chain. A static ``tree``: its choice list; a dynamic tree
    (``tree_nodes``): EAGLE-2's growth with ``acceptance``'s path chances standing in for
    the draft's, ``tree_top_k`` nodes a level expanded; n-gram ``branches``: that many chains."""
    if getattr(config, "tree", None):
        paths = sorted((tuple(c) for c in config.tree), key=lambda p: (len(p), p))
        parents = {p[:-1] for p in paths}
        depth = max(map(len, paths))
        return paths, [1] + [sum(1 for p in paths if len(p) == d and p in parents) for d in range(1, depth)]
    if getattr(config, "tree_nodes", 0):
        top_k, score = config.tree_top_k, lambda p: math.prod(acceptance.chance(d, r) for d, r in enumerate(p))
        frontier, grown = [()], []
        for _ in range(config.tree_depth):
            level = [(*p, r) for p in frontier for r in range(top_k)]
            grown += level
            frontier = sorted(level, key=lambda p: (-score(p), p))[:top_k]
        paths = sorted(grown, key=lambda p: (-score(p), len(p), p))[:config.tree_nodes]
        return paths, [1] + [min(top_k, top_k ** d) for d in range(1, config.tree_depth)]
    if getattr(config, "branches", 1) > 1:
        k = config.num_speculative_tokens
        return sorted(((b,) + (0,) * d for b in range(config.branches) for d in range(k)),
                      key=lambda p: (len(p), p)), []
    return None
