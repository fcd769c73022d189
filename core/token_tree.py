"""Token trees: the shape rules of a speculative proposal's tree and the attention
layout that runs a tree through the model in one pass.

A tree is a list of parent indices, one per node, in node order: ``parents[i]`` is the
node that node i continues, or -1 for a node that continues the request's last committed
token. A chain of k drafts is the tree ``[-1, 0, 1, ..., k-2]``. A tree's nodes take
consecutive KV slots in node order, and each node sits at the position of its depth.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from servelab.core.attention import TreeMask
from servelab.core.batch_builder import StepInputs
from servelab.core.errors import ProposalError

if TYPE_CHECKING:
    from servelab.core.decoding import Proposal
    from servelab.core.scheduler import SchedulerOutput


def chain(length: int) -> list[int]:
    """The parents of a chain of ``length`` nodes."""
    return list(range(-1, length - 1))


def tree_problem(parents: Sequence[int], num_tokens: int, budget: int) -> str | None:
    """The rule a tree of ``num_tokens`` draft tokens with ``parents`` breaks (None when it
    is well formed): one parent per token, at most ``budget`` nodes, parents that exist and
    come before their children (which also excludes cycles)."""
    count = len(parents)
    if count != num_tokens:
        return f"it gives {count} parents for {num_tokens} draft tokens (one parent per token)"
    if count > budget:
        return (f"it has {count} nodes, more than the {budget} this step allows "
                f"(num_lookahead_tokens, cut at max_model_len)")
    for node, parent in enumerate(parents):
        if parent < -1 or parent >= count:
            return f"node {node}'s parent {parent} is not a node (-1: the last committed token, else 0..{count - 1})"
        if parent >= node:
            return (f"nodes {_cycle_through(parents, node)} form a cycle" if _in_cycle(parents, node)
                    else f"node {node}'s parent {parent} comes after it (a parent must precede its children)")
    return None


def _in_cycle(parents: Sequence[int], node: int) -> bool:
    seen, current = 0, parents[node]
    while 0 <= current < len(parents) and seen <= len(parents):
        if current == node:
            return True
        current, seen = parents[current], seen + 1
    return False


def _cycle_through(parents: Sequence[int], node: int) -> str:
    members, current = [node], parents[node]
    while current != node:
        members.append(current)
        current = parents[current]
    return " -> ".join(map(str, members + [node]))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 0 for a node whose parent is -1."""
    result: list[int] = []
    for parent in parents:
        result.append(result[parent] + 1 if parent >= 0 else 0)
    return result


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[n, n] bool: ``mask[i, j]`` when node j is node i or one of its ancestors."""
    count = len(parents)
    mask = np.eye(count, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask


def verified_region(parents: Sequence[int]) -> list[int]:
    """The tree the target runs to verify draft nodes ``parents``: the last committed
    token (the root, region node 0) followed by the drafts."""
    return [-1] + [p + 1 for p in parents]


def with_trees(inputs: StepInputs, regions: Sequence[Sequence[int] | None]) -> StepInputs:
    """``inputs`` with request r's last ``len(regions[r])`` context tokens laid out as the
    tree ``regions[r]`` (None or empty: causal): its new tokens (the last query rows,
    all inside the tree) sit at the position of the tree's first key plus their depth
    and read only their ancestors among the tree's keys."""
    layout = inputs.layout
    lens = tuple(len(region) if region else 0 for region in regions)
    mask = np.zeros((int(inputs.input_ids.shape[0]), max(lens)), dtype=bool)
    positions = inputs.positions.cpu().numpy().copy()
    start = 0
    for region, query_len, seq_len in zip(regions, layout.query_lens, layout.seq_lens_list):
        if region:
            size = len(region)
            first_new = size - query_len
            mask[start:start + query_len, :size] = ancestor_mask(region)[first_new:]
            positions[start:start + query_len] = seq_len - size + np.asarray(depths(region)[first_new:])
        start += query_len
    device = inputs.positions.device
    tree = TreeMask(torch.from_numpy(mask).to(device), lens, torch.tensor(lens, dtype=torch.int32, device=device))
    return replace(inputs, positions=torch.from_numpy(positions).to(device), layout=replace(layout, tree=tree),
                   group_layouts=tuple(replace(g, tree=tree) for g in inputs.group_layouts))


def verified_tree_inputs(inputs: StepInputs, output: SchedulerOutput, proposal: Proposal,
                         allowances: Sequence[int], strategy: str) -> StepInputs:
    """``inputs`` (built with ``proposal``'s drafts) with each sampling request's last
    token and drafts laid out as its tree, after checking every tree against the rules
    (``tree_problem``, budget ``allowances[i]``); a broken rule raises ``ProposalError``
    naming the request and the rule."""
    sampling = [grant for grant in output.scheduled if grant.samples]
    if len(proposal.parents) != len(sampling):
        raise ProposalError(sampling[0].request.request_id if sampling else "-", strategy,
                            f"it gives {len(proposal.parents)} trees for {len(sampling)} requests")
    regions = iter(verified_region(parents) if parents else None for parents in proposal.parents)
    for grant, drafts, parents, allowance in zip(sampling, proposal.draft_token_ids, proposal.parents, allowances):
        problem = tree_problem(parents, len(drafts), allowance)
        if problem is not None:
            raise ProposalError(grant.request.request_id, strategy, problem)
    laid_out = [next(regions) if grant.samples else None for grant in output.scheduled]
    return with_trees(inputs, laid_out) if any(laid_out) else inputs


def kept_path_slots(output: SchedulerOutput, accepted_nodes: Sequence[Sequence[int]],
                    block_size: int) -> tuple[list[int], list[int]]:
    """The cache slots (sources, destinations) that move each sampling request's kept
    path of tree nodes to the slots right after its last token (node n of a request whose
    last token sits at position c was written at c + 1 + n; the kept node at depth d
    belongs at c + 1 + d). Nodes already in place are left out."""
    sources: list[int] = []
    destinations: list[int] = []
    sampling = [grant for grant in output.scheduled if grant.samples]
    for grant, path in zip(sampling, accepted_nodes):
        table = grant.block_tables[0]
        first = grant.num_computed_tokens + grant.num_new_tokens
        for depth, node in enumerate(path):
            if node != depth:
                for position, slots in ((first + node, sources), (first + depth, destinations)):
                    slots.append(table[position // block_size] * block_size + position % block_size)
    return sources, destinations
