"""An EAGLE-style draft head (Li et al., 2024): one decoder layer that drafts from the
target's last hidden states.

Head position j of a request reads the target's hidden state at request position
``start + j`` (its final norm's output) and the request's next token there:
``fc([h; embed(token)])``, one Llama decoder layer and a final norm give a stand-in for the
target's next hidden state, and the target's own LM head turns it into draft logits. A
draft token deeper in the tree reads its parent's stand-in instead of a target state. The
head keeps its own paged KV cache (``DraftModel``'s); the target's states arrive after
each step (``observe``), those of a prompt prefix the target found in its cache never do,
so the head's context then starts after it (``start``).

A head folder holds ``config.json`` (the layer's shape: ``hidden_size``, ``vocab_size``,
``intermediate_size``, heads, ``rms_norm_eps``, ``rope_theta``, ``max_position_embeddings``)
and ``model.safetensors`` (``fc.weight`` [hidden, 2 * hidden], ``model.layers.0.*``,
``model.norm.weight``), as ``examples/train_eagle_head.py`` writes it.
"""

from __future__ import annotations

import json
import os
from itertools import chain
from typing import Any, Sequence

import torch

from servelab.core.batch_builder import build_step_inputs
from servelab.core.checkpoint import Checkpoint
from servelab.core.decoding import DecodingContext, HiddenStates
from servelab.core.errors import ConfigError
from servelab.core.request import Request
from servelab.core.scheduler import ScheduledRequest
from servelab.plugins.decoding.draft_model import DraftModel, DraftSequence

SHARED_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")
"""The target's tensors the head reuses (its LM head only when not tied to the embedding)."""


def head_checkpoint(path: str, target: Checkpoint, field: str = "decoding.head_path") -> Checkpoint:
    """The head in folder ``path`` as a one-layer Llama checkpoint whose embedding and LM
    head are the ``target``'s; ``ConfigError`` naming the field that does not match the target."""
    from transformers import LlamaConfig

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError([f"{field}={path!r} is not an EAGLE head folder (no config.json)"])
    with open(config_path) as config_file:
        config = json.load(config_file)
    target_config = target.hf_config
    problems = [f"{field}: the head's {name} ({config.get(name)}) differs from the target's "
                f"({getattr(target_config, name, None)})" for name in ("hidden_size", "vocab_size")
                if config.get(name) != getattr(target_config, name, None)]
    if problems:
        raise ConfigError(problems)
    keys = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act", "rope_theta")
    hf_config = LlamaConfig(**{k: config[k] for k in keys if k in config}, num_hidden_layers=1,
                            tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)))
    shared = SHARED_WEIGHTS[:1] if hf_config.tie_word_embeddings else SHARED_WEIGHTS

    def weights():
        from safetensors.torch import load_file

        own = ((n, t) for n, t in load_file(os.path.join(path, "model.safetensors")).items() if n != "fc.weight")
        return chain(own, ((n, t) for n, t in target.weights() if n in shared))

    return Checkpoint(hf_config, None, "LlamaForCausalLM", weights, path)


class HeadSequence(DraftSequence):
    """The head's copy of one request: head token j is the request's token
    ``start + j + 1``, read with ``features[j]``, the target's state at ``start + j``;
    ``root``: the head's output at its last committed position, ``nodes``: its outputs
    at the tree nodes drafted since, in the order they ran."""

    __slots__ = ("start", "features", "root", "nodes")

    def __init__(self, request_id: str, start: int, features: torch.Tensor):
        super().__init__(request_id)
        self.start = start
        self.features = features
        self.root: torch.Tensor | None = None
        self.nodes: list[torch.Tensor] = []


class EagleHead(DraftModel):
    """The head of folder ``path`` for the target of ``context``, drafting through
    ``TreeDrafter`` (``catch_up``, ``run_tree``) from the target states ``observe`` keeps."""

    def __init__(self, path: str, context: DecodingContext, block_size: int, memory_bytes: int):
        super().__init__(head_checkpoint(path, context.checkpoint), context, block_size, memory_bytes)
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), "pt") as weights:
            self.fc = weights.get_tensor("fc.weight").to(self.device, context.dtype)
        self.embedding = self.worker.model.model.embed_tokens
        self.dtype = context.dtype

    def observe(self, hidden: HiddenStates) -> None:
        """Keep the target's states of each request's kept tokens; the head's cache drops
        what it held from their first position on (the drafted tree, or a recomputed span)."""
        offset = 0
        for request, first, count in zip(hidden.requests, hidden.first_positions, hidden.counts):
            rows = hidden.states[offset:offset + count].to(self.dtype)
            offset += count
            sequence = self.sequences.get(request.request_id)
            if not count:
                continue
            if sequence is None or not sequence.start <= first <= sequence.start + len(sequence.features):
                self.release(request.request_id)
                self.sequences[request.request_id] = HeadSequence(request.request_id, first, rows)
                continue
            keep = first - sequence.start
            sequence.features = torch.cat((sequence.features[:keep], rows))
            self.rollback(request, keep)

    @torch.inference_mode()
    def catch_up(self, requests: Sequence[Request]) -> tuple[list[int], torch.Tensor | None]:
        """Run each request's head positions not cached yet (at least its last): the
        indices (into ``requests``) of those with states and room, and their logits at
        the last position (the first drafts')."""
        live = []
        for k, request in enumerate(requests):
            sequence = self.sequences.get(request.request_id)
            if sequence is None:
                continue
            sequence.token_ids = list(request.token_ids[sequence.start + 1:sequence.start + 1 + len(sequence.features)])
            self.rollback(request, min(sequence.num_computed_tokens, len(sequence.token_ids) - 1))
            live.append(k)
        grants = self._grant([self.sequences[requests[k].request_id] for k in live])
        kept = [(k, g) for k, g in zip(live, grants) if g is not None]
        if not kept:
            return [], None
        features = torch.cat([g.request.features[g.num_computed_tokens:g.num_computed_tokens + g.num_new_tokens]
                              for _, g in kept])
        inputs = build_step_inputs([g for _, g in kept], (), self.cache.block_size, self.device)
        hidden, logits = self._run(inputs, [g for _, g in kept], features)
        for (_, grant), row in zip(kept, inputs.logits_indices.tolist()):
            grant.request.root, grant.request.nodes = hidden[row], []
        return [k for k, _ in kept], logits

    @torch.inference_mode()
    def run_tree(self, requests: Sequence[Request], new_tokens: Sequence[list[int]],
                 regions: Sequence[list[int]]) -> tuple[list[int], torch.Tensor | None]:
        """Run ``new_tokens[i]``, the last nodes of request i's tree ``regions[i]`` (parents
        over the tree's nodes; -1: the last committed token), each reading its parent's
        output: the indices of the requests that had room and logits for each new token."""
        sequences = [self.sequences[request.request_id] for request in requests]
        parents = [[sequence.root if p < 0 else sequence.nodes[p] for p in region[len(region) - len(tokens):]]
                   for sequence, tokens, region in zip(sequences, new_tokens, regions)]
        grants, kept, inputs = self._tree_step(requests, new_tokens, regions)
        if inputs is None:
            return kept, None
        hidden, logits = self._run(inputs, [grants[k] for k in kept], torch.stack([f for k in kept for f in parents[k]]))
        start = 0
        for k in kept:
            count = len(new_tokens[k])
            sequences[k].nodes += list(hidden[start:start + count])
            start += count
        return kept, logits

    def _run(self, inputs: Any, grants: list[ScheduledRequest], features: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The head over ``inputs`` with ``features`` [T, hidden] beside the embedded tokens:
        its outputs (the next states' stand-ins) and logits; the grants' tokens count as cached."""
        embedded = self.embedding(inputs.input_ids)
        first = torch.nn.functional.linear(torch.cat((features, embedded), dim=-1), self.fc)
        hidden, logits = self.worker.hidden_and_logits(inputs, (first, None))
        for grant in grants:
            grant.request.num_computed_tokens += grant.num_new_tokens
        return hidden, logits
