"""``decoding=speculative``: a draft model proposes k tokens, the target verifies k+1."""

from __future__ import annotations

from dataclasses import dataclass
from random import Random
from typing import List, Optional

import torch

from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, DecodingStrategy, Proposal
from servelab.core.checkpoint import load_checkpoint
from servelab.core.errors import ConfigError
from servelab.core.request import Request
from servelab.plugins.decoding.draft_model import DraftModel
from servelab.plugins.decoding.draft_tree import TreeDrafter, tree_config_problems
from servelab.plugins.decoding.speculative_sampling import simulated_acceptance, speculation_problems, verify


@dataclass
class SpeculativeDecodingConfig:
    """``draft``: a model preset (``model=<name>``); ``draft_path``: a Hugging Face folder
    instead. ``num_speculative_tokens``: k drafts per request per step. The draft keeps
    its own paged cache of ``draft_block_size`` blocks in ``draft_memory_bytes``; k = 0
    drafts nothing (the target alone: a k sweep's baseline).
    ``simulated_acceptance_rate``: under ``executor=simulated``, the probability that the
    target accepts each draft token (the draft model's passes are priced, not run).

    Token trees instead of a chain (``plugins/decoding/draft_tree.py``): ``tree``, a static
    shape as a choice list (``[[0], [1], [0, 0]]``: each node by the child ranks on its
    path); or ``tree_nodes`` > 0, a dynamic tree of that many nodes at most
    ``tree_depth`` deep, expanding the ``tree_top_k`` most probable nodes of each level
    into ``tree_top_k`` children. A tree of N nodes takes N lookahead tokens (it replaces
    ``num_speculative_tokens``)."""

    draft: str = "tiny-draft"
    draft_path: Optional[str] = None
    num_speculative_tokens: int = 3
    draft_block_size: int = 16
    draft_memory_bytes: int = 256 * 1024 * 1024
    simulated_acceptance_rate: float = 0.7
    tree: Optional[List[List[int]]] = None
    tree_nodes: int = 0
    tree_depth: int = 4
    tree_top_k: int = 4


class SpeculativeDecoding(DecodingStrategy):
    """Draft-model speculative decoding with the speculative sampling acceptance rule:
    the output distribution is the target's, and temperature 0 reproduces greedy."""

    def __init__(self, config: SpeculativeDecodingConfig, context=None):
        super().__init__(config, context)
        problems = speculation_problems(config) + tree_config_problems(config)
        if problems:
            raise ConfigError(problems)
        self.num_lookahead_tokens = (len(config.tree) if config.tree else config.tree_nodes or
                                     config.num_speculative_tokens)
        self.proposes_trees = bool(config.tree or config.tree_nodes)
        self.trees = None
        if context.runs_model:
            self.draft = DraftModel(load_checkpoint(self._draft_model_config()), context, config.draft_block_size,
                                    config.draft_memory_bytes)
            self.draft_model_shape = self.draft.shape
            if config.tree or config.tree_nodes:
                self.trees = TreeDrafter(self.draft, config.tree, config.tree_nodes, config.tree_depth,
                                         config.tree_top_k, context.max_model_len)
        else:
            checkpoint = load_checkpoint(self._draft_model_config())
            self.draft_model_shape = context.registry.get("model", checkpoint.architecture).cls.shape_of(
                checkpoint.hf_config)

    def _draft_model_config(self):
        from servelab.core.entrypoints.compose import compose_config
        from servelab.core.config import ModelConfig

        if self.config.draft_path:
            return ModelConfig(path=self.config.draft_path)
        return compose_config([f"model={self.config.draft}"]).model

    def propose(self, batch: DecodeBatch) -> Proposal:
        """Draft tokens (a chain or a token tree) from the draft model for every request
        allowed lookahead."""
        if self.trees is not None:
            return self.trees.propose(batch.requests, batch.num_draft_tokens)
        drafts, probs = self.draft.propose(batch.requests, batch.num_draft_tokens)
        return Proposal(tuple(drafts), probs)

    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """Verify, then roll the draft cache back to the tokens that survived (a tree's
        whole: the kept path runs through the draft again with the next step's catch-up)."""
        result = verify(logits, batch, proposal)
        for request, kept in zip(batch.requests, result.num_accepted_drafts):
            self.draft.rollback(request, request.num_tokens + (kept if self.trees is None else 0))
        return result

    def on_request_finished(self, request: Request) -> None:
        """Free the request's draft cache."""
        if self.context.runs_model:
            self.draft.release(request.request_id)

    def shutdown(self) -> None:
        """Drop the draft model and its KV tensors."""
        if self.context.runs_model:
            self.draft.close()

    def simulated_acceptance(self, allowances: tuple[int, ...], random: Random) -> list[int]:
        """Each draft kept with probability ``simulated_acceptance_rate`` (a tree: along
        one path, at most its depth)."""
        if self.config.tree or self.config.tree_nodes:
            depth = max(map(len, self.config.tree)) if self.config.tree else self.config.tree_depth
            allowances = tuple(min(a, depth) for a in allowances)
        return simulated_acceptance(allowances, self.config.simulated_acceptance_rate, random)



SPEC = ComponentSpec("decoding", "speculative", SpeculativeDecoding, SpeculativeDecodingConfig,
                     "draft-model speculative decoding (speculative sampling rule)")
