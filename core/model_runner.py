"""Runs one scheduled step: inputs, forward pass, logits, decoding."""

from __future__ import annotations

from typing import Any

import torch

from servelab.core.batch_builder import build_step_inputs
from servelab.core.decoding import DecodeBatch, DecodeResult, DecodingStrategy
from servelab.kernels.heap_retention import retain_freed_heap_memory
from servelab.kernels.huge_pages import huge_page_zeros
from servelab.core.scheduler import SchedulerOutput


class ModelRunner:
    """Owns the model, the per-layer KV cache tensors and the decoding strategy."""

    def __init__(self, model: torch.nn.Module, attention: Any, cache: Any, strategy: DecodingStrategy,
                 num_layers: int, max_model_len: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.attention = attention
        self.cache = cache
        self.strategy = strategy
        self.max_model_len = max_model_len
        self.device = device
        if device.type == "cpu":
            retain_freed_heap_memory()
        shape = attention.kv_cache_shape(cache.num_blocks, cache.block_size)
        self.kv_caches = [huge_page_zeros(shape, dtype, device) for _ in range(num_layers)]
        host_blocks = cache.num_host_blocks
        host_shape = attention.kv_cache_shape(host_blocks, cache.block_size)
        self.host_caches = [torch.zeros(host_shape, dtype=dtype, pin_memory=device.type == "cuda")
                            for _ in range(num_layers if host_blocks else 0)]

    def _copy(self, sources: list[torch.Tensor], destinations: list[torch.Tensor], pairs) -> None:
        """Copy blocks ``pairs`` (source, destination) from each source to each destination
        layer, along the attention backend's ``kv_cache_block_axis``."""
        if not pairs:
            return
        axis = self.attention.kv_cache_block_axis
        for source, destination in zip(sources, destinations):
            src = torch.tensor([s for s, _ in pairs], device=source.device)
            dst = torch.tensor([d for _, d in pairs], device=destination.device)
            blocks = source.index_select(axis, src).to(destination.device, non_blocking=True)
            destination.index_copy_(axis, dst, blocks)

    def move_blocks(self, output: SchedulerOutput) -> None:
        """Swap out, copy-on-write, then swap in, before the step's forward pass."""
        self._copy(self.kv_caches, self.host_caches, output.blocks_to_swap_out)
        self._copy(self.kv_caches, self.kv_caches, output.blocks_to_copy)
        self._copy(self.host_caches, self.kv_caches, output.blocks_to_swap_in)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> DecodeResult | None:
        """Run the step; returns the tokens of the requests that sample (None if none do)."""
        self.move_blocks(output)
        if not output.scheduled:
            return None
        sampling = output.sampling_requests
        proposal = None
        if sampling and self.strategy.num_lookahead_tokens:
            allowance = tuple(
                min(output.num_lookahead_tokens, self.max_model_len - g.request.num_tokens)
                if g.samples and g.num_new_tokens == 1 else 0
                for g in output.scheduled if g.samples)
            proposal = self.strategy.propose(DecodeBatch(sampling, allowance, output))
        drafts = proposal.draft_token_ids if proposal is not None else ()
        inputs = build_step_inputs(output.scheduled, drafts, self.cache.block_size, self.device)
        meta = self.attention.build_metadata(inputs.layout)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        if not sampling:
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        counts = tuple(len(d) for d in drafts) if drafts else (0,) * len(sampling)
        return self.strategy.accept(logits, DecodeBatch(sampling, counts, output), proposal)
