"""Token trees from a draft model: static shapes given as choice lists, and dynamic
trees grown by cumulative draft probability under a node budget.

A choice list names each node by the ranks of the children on its path from the root:
``[[0], [1], [0, 0], [0, 1]]`` is the draft's two best first tokens, each followed by the
two best tokens after the first of them (Medusa's and EAGLE's tree choices). A dynamic
tree (EAGLE-2) expands, level by level, the ``top_k`` nodes of the level whose path is
most probable under the draft with ``top_k`` children each, then keeps the ``budget``
most probable nodes of everything drafted.

Children of a greedy request's node are the draft's top tokens; a sampled request's
children in a static tree are drawn from the draft's distribution q without replacement
(each carrying q without its earlier siblings, renormalized, for the verifier). Dynamic
trees keep the top tokens for every request: their reranking looks at the drafted
tokens, so the verifier treats them as deterministic proposals (one-hot q).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from servelab.core.decoding import Proposal
from servelab.core.request import Request
from servelab.plugins.decoding.draft_model import DraftModel
from servelab.plugins.decoding.sampler import processed_logits, request_generator
from servelab.plugins.decoding.speculative_sampling import target_probabilities


def choice_problems(choices: Sequence[Sequence[int]], name: str = "decoding.tree") -> list[str]:
    """What is wrong with a choice list: every node a non-empty list of ranks >= 0, no
    node twice, each node's parent and its lower-ranked siblings listed too."""
    paths = [tuple(c) for c in choices]
    problems = []
    if not paths:
        problems.append(f"{name} must list at least one node, e.g. [[0], [1], [0, 0]]")
    for path in paths:
        if not path or any(not isinstance(r, int) or r < 0 for r in path):
            problems.append(f"{name}: node {list(path)} must be a non-empty list of child ranks >= 0")
        elif len(path) > 1 and path[:-1] not in paths:
            problems.append(f"{name}: node {list(path)} has no parent {list(path[:-1])} in the list")
        elif path[-1] and (*path[:-1], path[-1] - 1) not in paths:
            problems.append(f"{name}: node {list(path)} needs its sibling {[*path[:-1], path[-1] - 1]} in the list")
    if len(set(paths)) != len(paths):
        problems.append(f"{name} lists a node twice")
    return problems


def tree_config_problems(config) -> list[str]:
    """What is wrong with a speculative config's ``tree`` / ``tree_nodes`` /
    ``tree_depth`` / ``tree_top_k``."""
    problems = []
    if config.tree is not None:
        problems += choice_problems(config.tree)
        if config.tree_nodes:
            problems.append("decoding.tree (a static shape) and decoding.tree_nodes (a dynamic tree) exclude "
                            "each other; set one")
    if config.tree_nodes < 0:
        problems.append(f"decoding.tree_nodes must be >= 0 (0: no dynamic tree), got {config.tree_nodes}")
    if config.tree_nodes and (config.tree_depth < 1 or config.tree_top_k < 1):
        problems.append(f"decoding.tree_depth and decoding.tree_top_k must be >= 1, got {config.tree_depth} "
                        f"and {config.tree_top_k}")
    return problems


@dataclass
class Candidates:
    """One request's drafted nodes in creation order (parents first): ``tokens``,
    ``parents`` (-1: the request's last token), ``scores`` (the draft probability of the
    path), ``q`` (the distribution each was drawn from; None: one-hot), ``paths`` (ranks
    from the root), and ``region``: the nodes run through the draft model, in order."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    paths: list[tuple[int, ...]] = field(default_factory=list)
    region: list[int] = field(default_factory=list)

    def depth(self, node: int) -> int:
        """Edges from the root to ``node``."""
        return len(self.paths[node])


class TreeDrafter:
    """Drafts a token tree per request with ``draft``: a static shape (``choices``) or,
    when ``choices`` is None, a dynamic tree of ``budget`` nodes, ``depth`` levels deep,
    expanding ``top_k`` nodes per level into ``top_k`` children each."""

    def __init__(self, draft: DraftModel, choices: Sequence[Sequence[int]] | None, budget: int, depth: int,
                 top_k: int, max_model_len: int):
        self.draft = draft
        self.max_model_len = max_model_len
        self.shape = sorted((tuple(c) for c in choices), key=lambda p: (len(p), p)) if choices else None
        self.budget = len(self.shape) if self.shape else budget
        self.depth = max(map(len, self.shape)) if self.shape else depth
        self.top_k = top_k
        self._shape_children: dict[tuple[int, ...], int] = {}
        for path in self.shape or ():
            self._shape_children[path[:-1]] = max(self._shape_children.get(path[:-1], 0), path[-1] + 1)

    def propose(self, requests: Sequence[Request], allowances: Sequence[int]) -> Proposal:
        """A tree of at most ``allowances[i]`` nodes per request."""
        trees = [Candidates() for _ in requests]
        active = [i for i, allowance in enumerate(allowances) if allowance]
        kept, logits = self.draft.catch_up([requests[i] for i in active])
        frontier = [(active[k], -1) for k in kept]
        for level in range(self.depth):
            if not frontier:
                break
            self._expand(trees, requests, frontier, logits)
            if level + 1 == self.depth:
                break
            frontier = self._next_frontier(trees, requests, sorted({i for i, _ in frontier}), level + 1)
            logits = self._run(trees, requests, frontier)
            frontier = [entry for entry, row in zip(frontier, logits[1]) if row] if logits else []
            logits = logits[0] if logits else None
        return self._proposal(trees, allowances)

    def _expand(self, trees: list[Candidates], requests: Sequence[Request], frontier: list[tuple[int, int]],
                logits: torch.Tensor) -> None:
        """Add the children of each frontier node (request, node) from its draft logits row."""
        owners = [requests[i] for i, _ in frontier]
        q = target_probabilities(logits.clone(), owners)
        ranking = processed_logits(logits.clone(), owners).softmax(dim=-1)
        for row, (i, node) in enumerate(frontier):
            tree, request = trees[i], owners[row]
            path = tree.paths[node] if node >= 0 else ()
            count = self._shape_children.get(path, 0) if self.shape else self.top_k
            sampled = self.shape is not None and not request.sampling_params.greedy
            weights = q[row] if not request.sampling_params.greedy else ranking[row]
            count = min(count, int((weights > 0).sum()))
            if sampled:
                noise = torch.empty_like(weights).exponential_(generator=request_generator(request, weights.device))
                chosen = weights.div(noise).topk(count).indices.tolist()
            else:
                chosen = weights.topk(count).indices.tolist()
            parent_score = tree.scores[node] if node >= 0 else 1.0
            remaining = q[row].clone() if sampled else None
            for rank, token in enumerate(chosen):
                tree.tokens.append(token)
                tree.parents.append(node)
                tree.scores.append(parent_score * float(weights[token]))
                tree.paths.append((*path, rank))
                if remaining is not None:
                    tree.q.append(remaining / remaining.sum())
                    remaining[token] = 0.0
                else:
                    tree.q.append(None)

    def _next_frontier(self, trees: list[Candidates], requests: Sequence[Request], active: list[int],
                       depth: int) -> list[tuple[int, int]]:
        """The nodes at ``depth`` to expand next: those with children in the static shape,
        or the ``top_k`` most probable paths of the level; no more than the draft's cache
        holds before ``max_model_len`` (the nodes it runs follow the request's tokens)."""
        frontier = []
        for i in active:
            tree = trees[i]
            level = [n for n in range(len(tree.tokens)) if tree.depth(n) == depth]
            if self.shape:
                chosen = [n for n in level if self._shape_children.get(tree.paths[n])]
            else:
                chosen = sorted(level, key=lambda n: -tree.scores[n])[:self.top_k]
            room = self.max_model_len - requests[i].num_tokens - len(tree.region)
            frontier += [(i, n) for n in chosen[:max(room, 0)]]
        return sorted(frontier)

    def _run(self, trees: list[Candidates], requests: Sequence[Request],
             frontier: list[tuple[int, int]]) -> tuple[torch.Tensor, list[bool]] | None:
        """Run the frontier nodes through the draft model (each reading its ancestors):
        their logits rows and, per frontier entry, whether its request still had room."""
        if not frontier:
            return None
        order = sorted({i for i, _ in frontier})
        new = {i: [n for j, n in frontier if j == i] for i in order}
        regions = []
        for i in order:
            tree = trees[i]
            tree.region += new[i]
            index = {node: k for k, node in enumerate(tree.region)}
            regions.append([index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in tree.region])
        kept, logits = self.draft.run_tree([requests[i] for i in order], [[trees[i].tokens[n] for n in new[i]]
                                                                          for i in order], regions)
        alive = {order[k] for k in kept}
        return (logits, [i in alive for i, _ in frontier]) if kept else None

    def _proposal(self, trees: list[Candidates], allowances: Sequence[int]) -> Proposal:
        """Each request's tree cut to its allowance (the first nodes of a static shape, the
        most probable of a dynamic tree), parents renumbered."""
        drafts, parents, rows = [], [], []
        for tree, allowance in zip(trees, allowances):
            count = min(allowance, self.budget, len(tree.tokens))
            if self.shape:
                nodes = list(range(count))
            else:
                nodes = sorted(sorted(range(len(tree.tokens)), key=lambda n: (-tree.scores[n], n))[:count])
            index = {node: k for k, node in enumerate(nodes)}
            drafts.append([tree.tokens[n] for n in nodes])
            parents.append([index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in nodes])
            rows += [(tree.tokens[n], tree.q[n]) for n in nodes]
        probs = None
        if any(q is not None for _, q in rows):
            vocab = next(q for _, q in rows if q is not None).shape[-1]
            probs = torch.stack([q if q is not None else
                                 torch.nn.functional.one_hot(torch.tensor(t), vocab).float() for t, q in rows])
        return Proposal(tuple(drafts), probs, tuple(parents))
