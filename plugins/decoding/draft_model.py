"""A small model that drafts tokens for speculative decoding, with its own KV cache."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from servelab.core.batch_builder import build_step_inputs
from servelab.core.checkpoint import Checkpoint
from servelab.core.decoding import DecodingContext
from servelab.core.errors import ConfigError
from servelab.core.kv_cache import CacheContext
from servelab.core.request import Request
from servelab.core.engine.resolved_model import ResolvedModel
from servelab.core.scheduler import ScheduledRequest
from servelab.core.token_tree import with_trees
from servelab.plugins.decoding.sampler import random_race
from servelab.plugins.decoding.speculative_sampling import target_probabilities
from servelab.plugins.executor.device_worker import DeviceWorker


class DraftSequence:
    """The draft model's copy of one request: its tokens (plus drafts) and how many of
    them are in the draft's KV cache."""

    __slots__ = ("request_id", "token_ids", "num_computed_tokens")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Tokens known, drafts included."""
        return len(self.token_ids)


class DraftModel:
    """Loads the draft ``checkpoint`` beside the target (same vocabulary) into a
    ``DeviceWorker`` of its own and runs its forward passes over a private paged cache
    (``cache=paged``, built from the registry), catching up on each request's accepted
    tokens before drafting."""

    def __init__(self, checkpoint: Checkpoint, context: DecodingContext, block_size: int, memory_bytes: int):
        registry = context.registry
        model_cls = registry.get("model", checkpoint.architecture).cls
        shape = model_cls.shape_of(checkpoint.hf_config)
        max_len = context.max_model_len
        problems = []
        if shape.vocab_size != context.vocab_size:
            problems.append(f"the draft model's vocabulary ({shape.vocab_size}) differs from the target's "
                            f"({context.vocab_size}); draft and target must share a tokenizer")
        if shape.max_positions < max_len:
            problems.append(f"the draft model supports {shape.max_positions} positions, fewer than "
                            f"model.max_model_len={max_len}")
        if problems:
            raise ConfigError(problems)
        self.shape = shape
        self.device, dtype = context.device, context.dtype
        paged = registry.get("cache", "paged").config_cls(block_size=block_size, memory_bytes=memory_bytes)
        self.cache = registry.build("cache", paged, CacheContext(shape.kv_cache_spec(dtype, max_len), registry))
        model = ResolvedModel(checkpoint=checkpoint, model_cls=model_cls, shape=shape, device=self.device, dtype=dtype,
                              kv_dtype=dtype, max_model_len=max_len)
        self.worker = DeviceWorker.load(registry, model, context.attention_config)
        self.worker.allocate(self.cache.num_blocks, self.cache.block_size, groups=self.cache.groups)
        self.sequences: dict[str, DraftSequence] = {}

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], allowances: Sequence[int]) -> tuple[list[list[int]], torch.Tensor]:
        """Up to ``allowances[i]`` draft tokens per request and the draft distributions
        they were drawn from ([total drafts, V], in request order)."""
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        active = []
        for i, (request, allowance) in enumerate(zip(requests, allowances)):
            if allowance:
                sequence = self.sequences.setdefault(request.request_id, DraftSequence(request.request_id))
                sequence.token_ids = list(request.token_ids)
                active.append(i)
        for _ in range(max(allowances, default=0)):
            active = [i for i in active if len(drafts[i]) < allowances[i]]
            grants = self._grant([self.sequences[requests[i].request_id] for i in active])
            active = [i for i, grant in zip(active, grants) if grant is not None]
            if not active:
                break
            logits = self._forward([g for g in grants if g is not None])
            probs = target_probabilities(logits, [requests[i] for i in active])
            tokens = random_race(probs.clone(), [requests[i] for i in active]).tolist()
            for k, i in enumerate(active):
                drafts[i].append(tokens[k])
                rows[i].append(probs[k])
                self.sequences[requests[i].request_id].token_ids.append(tokens[k])
        flat = [row for request_rows in rows for row in request_rows]
        return drafts, torch.stack(flat) if flat else None

    @torch.inference_mode()
    def catch_up(self, requests: Sequence[Request]) -> tuple[list[int], torch.Tensor | None]:
        """Run each request's tokens the draft has not cached: the indices (into
        ``requests``) of those that had room, and the draft's logits at their last token."""
        sequences = []
        for request in requests:
            sequence = self.sequences.setdefault(request.request_id, DraftSequence(request.request_id))
            sequence.token_ids = list(request.token_ids)
            sequences.append(sequence)
        grants = self._grant(sequences)
        kept = [k for k, grant in enumerate(grants) if grant is not None]
        return kept, self._forward([grants[k] for k in kept]) if kept else None

    @torch.inference_mode()
    def run_tree(self, requests: Sequence[Request], new_tokens: Sequence[list[int]],
                 regions: Sequence[list[int]]) -> tuple[list[int], torch.Tensor | None]:
        """Append ``new_tokens[i]`` to request i's draft sequence as the last nodes of its
        token tree ``regions[i]`` (parents over the tree's nodes, which follow the
        request's tokens) and run them, each reading its ancestors only: the indices of
        the requests that had room, and logits for each of their new tokens in order."""
        grants, kept, inputs = self._tree_step(requests, new_tokens, regions)
        if inputs is None:
            return kept, None
        logits = self.worker.logits(inputs)
        for k in kept:
            grants[k].request.num_computed_tokens += grants[k].num_new_tokens
        return kept, logits

    def _tree_step(self, requests: Sequence[Request], new_tokens: Sequence[list[int]],
                   regions: Sequence[list[int]]) -> tuple[list[ScheduledRequest | None], list[int], Any]:
        """Append ``new_tokens[i]`` to request i's draft sequence and build the step that
        runs them as the last nodes of its tree ``regions[i]``, a logit row per token: the
        grants, the indices of the requests that had room, and the inputs (None when none
        had room)."""
        sequences = [self.sequences[request.request_id] for request in requests]
        for sequence, tokens in zip(sequences, new_tokens):
            sequence.token_ids += tokens
        grants = self._grant(sequences)
        kept = [k for k, grant in enumerate(grants) if grant is not None]
        if not kept:
            return grants, kept, None
        inputs = build_step_inputs([grants[k] for k in kept], (), self.cache.block_size, self.device)
        inputs = with_trees(inputs, [regions[k] for k in kept])
        return grants, kept, replace(inputs, logits_indices=torch.arange(inputs.input_ids.shape[0], device=self.device))

    def _grant(self, sequences: list[DraftSequence]) -> list[ScheduledRequest | None]:
        grants = []
        for sequence in sequences:
            num_new = sequence.num_tokens - sequence.num_computed_tokens
            if self.cache.allocate(sequence, num_new) is None:
                self.release(sequence.request_id)
                grants.append(None)
                continue
            grants.append(ScheduledRequest.of(sequence, num_new, self.cache, True))
        return grants

    def _forward(self, grants: list[ScheduledRequest]) -> torch.Tensor:
        logits = self.worker.logits(build_step_inputs(grants, (), self.cache.block_size, self.device))
        for grant in grants:
            grant.request.num_computed_tokens += grant.num_new_tokens
        return logits

    def rollback(self, request: Request, num_valid_tokens: int) -> None:
        """Keep only the first ``num_valid_tokens`` cached positions of the request."""
        sequence = self.sequences.get(request.request_id)
        if sequence is not None and sequence.num_computed_tokens > num_valid_tokens:
            sequence.num_computed_tokens = num_valid_tokens
            self.cache.truncate(sequence, num_valid_tokens)

    def release(self, request_id: str) -> None:
        """Forget a request and free its draft blocks."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.cache.free(sequence)

    def close(self) -> None:
        """Drop the draft model, its KV tensors and every request's draft state."""
        for request_id in list(self.sequences):
            self.release(request_id)
        self.worker.release()
