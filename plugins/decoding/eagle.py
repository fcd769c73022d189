"""``decoding=eagle``: an EAGLE-style head (``eagle_head.py``) drafts chains or token
trees from the target's last hidden states; the target verifies them in one pass."""

from __future__ import annotations

import os
from dataclasses import dataclass
from random import Random
from typing import List, Optional

import torch

from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, DecodingStrategy, HiddenStates, Proposal
from servelab.core.errors import ConfigError
from servelab.core.request import Request
from servelab.plugins.decoding.draft_tree import TreeDrafter, tree_config_problems
from servelab.plugins.decoding.speculative_sampling import simulated_acceptance, speculation_problems, verify


@dataclass
class EagleDecodingConfig:
    """``head_path``: the head's folder (None: ``<target folder>-eagle``, so
    ``checkpoints/tiny-eagle`` for ``model=tiny``). A chain of ``num_speculative_tokens``
    drafts; or a static tree ``tree`` (a choice list, e.g. ``[[0], [1], [0, 0]]``); or a
    dynamic EAGLE-2 tree of ``tree_nodes`` nodes at most ``tree_depth`` deep, expanding the
    ``tree_top_k`` most probable nodes of each level (as ``decoding=speculative``'s). The
    head's paged cache: ``head_block_size`` tokens a block in ``head_memory_bytes``.
    ``simulated_acceptance_rate``: each draft's chance under ``executor=simulated``."""

    head_path: Optional[str] = None
    num_speculative_tokens: int = 3
    tree: Optional[List[List[int]]] = None
    tree_nodes: int = 0
    tree_depth: int = 4
    tree_top_k: int = 4
    head_block_size: int = 16
    head_memory_bytes: int = 64 * 1024 * 1024
    simulated_acceptance_rate: float = 0.7


class EagleDecoding(DecodingStrategy):
    """Speculative decoding with an EAGLE-style head: drafts as token trees (a chain is
    the one-child tree), verified with the speculative sampling rule, so the output
    distribution is the target's and temperature 0 reproduces greedy decoding."""

    proposes_trees = True
    reads_hidden_states = True

    def __init__(self, config: EagleDecodingConfig, context=None):
        super().__init__(config, context)
        problems = speculation_problems(config) + tree_config_problems(config)
        if problems:
            raise ConfigError(problems)
        if context.checkpoint is None:
            raise ConfigError(["decoding=eagle reads the target's weights: DecodingContext.checkpoint is not set"])
        from servelab.plugins.decoding.eagle_head import EagleHead, head_checkpoint

        chain = [[0] * depth for depth in range(1, config.num_speculative_tokens + 1)]
        shape = config.tree or (None if config.tree_nodes else chain)
        self.num_lookahead_tokens = len(shape) if shape else config.tree_nodes
        path = config.head_path or f"{os.path.normpath(context.checkpoint.source)}-eagle"
        self.head = self.trees = None
        if context.runs_model and self.num_lookahead_tokens:
            self.head = EagleHead(path, context, config.head_block_size, config.head_memory_bytes)
            self.draft_model_shape = self.head.shape
            self.trees = TreeDrafter(self.head, shape, config.tree_nodes, config.tree_depth, config.tree_top_k,
                                     context.max_model_len)
        else:
            checkpoint = head_checkpoint(path, context.checkpoint)
            self.draft_model_shape = context.registry.get("model", checkpoint.architecture).cls.shape_of(
                checkpoint.hf_config)

    def propose(self, batch: DecodeBatch) -> Proposal:
        """A token tree (or chain) per request allowed lookahead, from the head."""
        return self.trees.propose(batch.requests, batch.num_draft_tokens)

    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """Verify the drafts (the head's cache drops them when the kept tokens' states come)."""
        return verify(logits, batch, proposal)

    def observe_hidden_states(self, hidden: HiddenStates) -> None:
        """Hand the kept tokens' target states to the head."""
        if self.head is not None:
            self.head.observe(hidden)

    def on_request_finished(self, request: Request) -> None:
        """Free the request's head cache and states."""
        if self.head is not None:
            self.head.release(request.request_id)

    def shutdown(self) -> None:
        """Drop the head and its KV tensors."""
        if self.head is not None:
            self.head.close()
            self.head = self.trees = None

    def simulated_acceptance(self, allowances: tuple[int, ...], random: Random) -> list[int]:
        """Each draft kept with probability ``simulated_acceptance_rate``, along one path."""
        depth = (max(map(len, self.config.tree)) if self.config.tree else
                 self.config.tree_depth if self.config.tree_nodes else self.config.num_speculative_tokens)
        return simulated_acceptance(tuple(min(a, depth) for a in allowances), self.config.simulated_acceptance_rate,
                                    random)


SPEC = ComponentSpec("decoding", "eagle", EagleDecoding, EagleDecodingConfig,
                     "EAGLE-style head drafting chains or token trees from the target's hidden states")
