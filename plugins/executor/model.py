"""``executor=model``: runs the model's forward pass for every step (the default)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from servelab.core.batch_builder import build_step_inputs
from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, DecodingStrategy, lookahead_allowances
from servelab.core.errors import ConfigError
from servelab.core.executor import Executor, ExecutorContext
from servelab.core.kv_cache import KVCacheManager, KVCacheSpec
from servelab.core.scheduler import SchedulerOutput
from servelab.kernels.heap_retention import retain_freed_heap_memory
from servelab.kernels.huge_pages import huge_page_zeros

CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
"""What a cache that sets no size gets on the CPU."""


@dataclass
class ModelExecutorConfig:
    """``executor=model``: no options."""


class ModelExecutor(Executor):
    """Owns the model, its attention backend and the per-layer KV cache tensors: builds
    each step's flat batch, runs the forward pass and lets the decoding strategy choose
    the tokens. Models without weights (shape presets) are refused."""

    def __init__(self, config: ModelExecutorConfig, context: ExecutorContext):
        super().__init__(config, context)
        registry, checkpoint = context.registry, context.checkpoint
        spec = context.shape.attention_spec(context.dtype, context.device, context.max_model_len)
        backend = registry.spec_for_config("attention", context.attention_config)
        problems = [f"attention={backend.name}: {reason}" for reason in
                    backend.cls.unsupported_reasons(OmegaConf.to_object(context.attention_config), spec)]
        if checkpoint.weights is None:
            problems.append(f"the model ({checkpoint.architecture} shape, {context.shape.num_parameters / 1e9:.1f}B "
                            f"parameters) has no weights: executor=model runs checkpoints; use executor=simulated "
                            f"to simulate it")
        if problems:
            raise ConfigError(problems)
        self.device = context.device
        self.max_model_len = context.max_model_len
        self.attention = registry.build("attention", context.attention_config, spec)
        model = context.model_cls(checkpoint.hf_config, self.attention, context.dtype, context.max_model_len)
        model.load_weights(checkpoint.weights())
        self.model = model.to(self.device).eval()
        self.kv_caches: list[torch.Tensor] = []
        self.host_caches: list[torch.Tensor] = []

    def kv_cache_budget_bytes(self, spec: KVCacheSpec) -> int | None:
        """``CPU_KV_CACHE_BYTES`` on the CPU; on a GPU the free device memory times
        ``hardware.memory_utilization``."""
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * self.context.engine_cfg.hardware.memory_utilization)

    def attach(self, cache: KVCacheManager, strategy: DecodingStrategy) -> None:
        """Allocate the KV cache tensors in the attention backend's layout (and the host
        pool's, for swapping)."""
        self.cache = cache
        self.strategy = strategy
        dtype, layers = self.context.dtype, self.context.shape.num_layers
        if self.device.type == "cpu":
            retain_freed_heap_memory()
        shape = self.attention.kv_cache_shape(cache.num_blocks, cache.block_size)
        self.kv_caches = [huge_page_zeros(shape, dtype, self.device) for _ in range(layers)]
        host_blocks = cache.num_host_blocks
        host_shape = self.attention.kv_cache_shape(host_blocks, cache.block_size)
        self.host_caches = [torch.zeros(host_shape, dtype=dtype, pin_memory=self.device.type == "cuda")
                            for _ in range(layers if host_blocks else 0)]

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
            allowance = lookahead_allowances(output, self.max_model_len)
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

    def warm_up(self, max_tokens: int) -> int:
        """The model's kernels for steps of up to ``max_tokens`` tokens (CPU matmuls)."""
        return self.model.warm_up(max_tokens)


SPEC = ComponentSpec("executor", "model", ModelExecutor, ModelExecutorConfig,
                     "runs the model's forward pass for every step (default)")
