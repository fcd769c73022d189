"""One device's part of ``executor=model``: the model (or this rank's share of it), its
attention backend and KV cache tensors, and the forward pass over a step's flat batch.

The executor's own device, every parallel worker (``distributed.py`` moves their inputs
and outputs between processes) and the speculative draft model each run one.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from servelab.core.attention import BatchLayout
from servelab.core.batch_builder import StepInputs
from servelab.core.checkpoint import Checkpoint
from servelab.core.kv_cache import KVCacheGroup, KVCacheSpec, single_group
from servelab.core.kv_cache_dtype import is_quantized
from servelab.core.model import CausalLM, ModelParallel
from servelab.core.engine.resolved_model import ResolvedModel
from servelab.platform import huge_page_zeros
from servelab.plugins.executor.layer_attention import LayerAttention, layer_attention
from servelab.plugins.models.quantized_linear import quantize_linears


class DeviceWorker:
    """One device's model, attention backend (a ``LayerAttention`` when layers differ in
    window) and KV cache tensors: ``block_tensors`` on the device (``host_tensors`` for
    swapping), one per layer, or, when the cache keeps several KV cache groups, one per
    position within a group, which every group's layer at that position shares;
    ``kv_caches`` lists each layer's tensor. ``kv_spec``: what the cache stores per token."""

    def __init__(self, model: Any, attention: Any, dtype: torch.dtype, device: torch.device, parallel: ModelParallel,
                 kv_spec: KVCacheSpec):
        self.model = model
        self.kv_spec = kv_spec
        self.num_layers = kv_spec.num_layers
        self.attention = attention
        self.dtype = dtype
        self.device = device
        self.parallel = parallel
        self.kv_caches: list[torch.Tensor] = []
        self.block_tensors: list[torch.Tensor] = []
        self.host_tensors: list[torch.Tensor] = []

    @classmethod
    def load(cls, registry: Any, model: ResolvedModel, attention_config: Any,
             parallel: ModelParallel = ModelParallel()) -> "DeviceWorker":
        """Load ``model``'s weights (``parallel``'s share of them) with the attention backend
        of ``attention_config`` built from ``registry``."""
        shape = model.shape
        specs = [shape.attention_spec(model.dtype, model.device, model.max_model_len, parallel.tp_size,
                                      model.kv_dtype, layer) for layer in parallel.layer_range(shape.num_layers)]
        attention = layer_attention(lambda spec: registry.build("attention", attention_config, spec), specs)
        network = load_model(model.checkpoint, model.model_cls, attention, model.dtype, model.max_model_len, parallel)
        kv_spec = shape.kv_cache_spec(model.kv_dtype or model.dtype, model.max_model_len, parallel.tp_size,
                                      parallel.pp_size)
        kv_spec = replace(kv_spec, num_layers=len(specs), layer_windows=kv_spec.layer_windows[:len(specs)])
        return cls(network.to(model.device).eval(), attention, model.dtype, model.device, parallel, kv_spec)

    @classmethod
    def for_rank(cls, cfg: Any, parallel: ModelParallel, rank: int) -> "DeviceWorker":
        """A parallel worker's share of the engine config ``cfg``'s model (resolved as the
        engine resolves it), on its own GPU when there are GPUs."""
        from servelab.core.engine.registry import get_registry

        registry = get_registry()
        model = ResolvedModel.of(cfg, registry)
        if model.device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
            torch.cuda.set_device(device)
            model = replace(model, device=device)
        return cls.load(registry, model, cfg.attention, parallel)

    def allocate(self, num_blocks: int, block_size: int, host_blocks: int = 0,
                 groups: tuple[KVCacheGroup, ...] | None = None) -> None:
        """KV tensors for this stage's layers (and the host pool's, for swapping), shared
        by the cache's ``groups`` (None: one group of every layer)."""
        groups = groups or single_group(self.kv_spec)
        dtype = self.attention.spec.cache_dtype
        shape = self.attention.kv_cache_shape(num_blocks, block_size)
        positions = len(groups[0].layers)
        self.block_tensors = [huge_page_zeros(shape, dtype, self.device) for _ in range(positions)]
        host = self.attention.kv_cache_shape(host_blocks, block_size)
        self.host_tensors = [torch.zeros(host, dtype=dtype) for _ in range(positions if host_blocks else 0)]
        position = {layer: index for group in groups for index, layer in enumerate(group.layers)}
        self.kv_caches = [self.block_tensors[position[layer]] for layer in range(self.num_layers)]
        if isinstance(self.attention, LayerAttention):
            self.attention.use_groups(groups)

    def move_blocks(self, moves: tuple) -> None:
        """Offload, swap in, swap out, then copy-on-write. Offloads first read the cached
        device blocks the step reuses (a swap-in may land in one); swapping in then reads
        every host block before a swap-out of the same step may reuse it (the cache frees a
        swapped-in request's host blocks at once); a swap-in's device blocks were taken
        before any swap-out of the step released its own, and copies write fresh blocks last."""
        offload, swap_in, swap_out, copy = moves
        copy_blocks(self.attention, self.block_tensors, self.host_tensors, offload)
        copy_blocks(self.attention, self.host_tensors, self.block_tensors, swap_in)
        copy_blocks(self.attention, self.block_tensors, self.host_tensors, swap_out)
        copy_blocks(self.attention, self.block_tensors, self.block_tensors, copy)

    def read_host_block(self, block: int) -> torch.Tensor:
        """Host block ``block`` of every layer, as one uint8 tensor (a copy)."""
        axis = self.attention.kv_cache_block_axis
        return torch.cat([t.select(axis, block).contiguous().view(torch.uint8).reshape(-1) for t in self.host_tensors])

    def write_host_block(self, block: int, content: torch.Tensor) -> None:
        """Put ``content`` (as ``read_host_block`` gives it) into host block ``block``."""
        axis, offset = self.attention.kv_cache_block_axis, 0
        for tensor in self.host_tensors:
            view = tensor.select(axis, block)
            size = view.numel() * view.element_size()
            view.copy_(content[offset:offset + size].view(view.dtype).view(view.shape))
            offset += size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layouts: tuple[BatchLayout, ...],
                carried: tuple | None = None) -> Any:
        """This stage's layers over the step (``layouts``: one per KV cache group): hidden
        states [T, hidden] on the last stage, else the state the next stage carries on with."""
        return self.model(input_ids, positions, self.kv_caches, self._metadata(layouts), carried)

    def _metadata(self, layouts: tuple[BatchLayout, ...]) -> Any:
        """The attention backend's metadata of a step's layouts (all of them for a backend
        that holds several KV cache groups, else the first)."""
        return self.attention.build_metadata(layouts if isinstance(self.attention, LayerAttention) else layouts[0])

    @torch.inference_mode()
    def logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """The whole model over one step's ``inputs`` on this device: float32 logits
        [N, vocab] at ``inputs.logits_indices`` (None when no row needs them)."""
        return self.hidden_and_logits(inputs)[1]

    @torch.inference_mode()
    def hidden_and_logits(self, inputs: StepInputs, carried: tuple | None = None) -> tuple[torch.Tensor, Any]:
        """The last hidden states of every token of ``inputs`` [T, hidden] and ``logits``'s
        rows; ``carried``: the first layer's input state instead of the embedded tokens."""
        if not inputs.logits_indices.numel():
            return self.forward(inputs.input_ids, inputs.positions, inputs.layouts, carried), None
        rows = None if inputs.logits_are_all_rows else inputs.logits_indices
        if carried is None:  # the model's whole step (its native stack may run it in one call)
            return self.model.hidden_and_logits(inputs.input_ids, inputs.positions, self.kv_caches,
                                                self._metadata(inputs.layouts), rows)
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.layouts, carried)
        return hidden, self.model.compute_logits(hidden if rows is None else hidden[rows])

    @torch.inference_mode()
    def greedy_steps(self, inputs: StepInputs, steps: int) -> torch.Tensor | None:
        """The model's ``greedy_steps`` over a decode step's ``inputs`` (advanced in place):
        tokens [steps, T], or None where the model runs them one at a time."""
        return self.model.greedy_steps(inputs.input_ids, inputs.positions, self.kv_caches,
                                       self._metadata(inputs.layouts), steps)

    @torch.inference_mode()
    def greedy_tokens_or_logits(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A plainly greedy decode step (every row one request's only token): its tokens
        [1, T] chosen in the model's call (``greedy_steps`` of one step; logits None), or,
        where the model has no such call, its logits [T, vocab] (tokens None); the attention
        metadata built once either way."""
        meta = self._metadata(inputs.layouts)
        tokens = self.model.greedy_steps(inputs.input_ids, inputs.positions, self.kv_caches, meta, 1)
        if tokens is not None:
            return tokens, None
        return None, self.model.hidden_and_logits(inputs.input_ids, inputs.positions, self.kv_caches, meta, None)[1]

    def release(self) -> None:
        """Drop the model, the attention backend and the KV tensors."""
        self.model = self.attention = None
        self.kv_caches, self.block_tensors, self.host_tensors = [], [], []


def load_model(checkpoint: Checkpoint, model_cls: type[CausalLM], attention: Any, dtype: torch.dtype,
               max_positions: int, parallel: ModelParallel = ModelParallel()) -> CausalLM:
    """``model_cls`` built for ``checkpoint`` (this ``parallel`` share), its decoder's linear
    layers quantized when the checkpoint says so, with the weights loaded (on the CPU)."""
    model = model_cls(checkpoint.hf_config, attention, dtype, max_positions, parallel)
    if checkpoint.quantization is not None:
        quantize_linears(model, checkpoint.quantization)
    model.load_weights(checkpoint.weights())
    return model


def copy_blocks(attention: Any, sources: list[torch.Tensor], destinations: list[torch.Tensor], pairs) -> None:
    """Copy blocks ``pairs`` (source, destination) from each source to each destination
    layer, along the attention backend's ``kv_cache_block_axis`` (a quantized cache as
    bytes: its values and scales together; torch has no float8 ``index_copy_``)."""
    if not pairs:
        return
    axis = attention.kv_cache_block_axis
    for source, destination in zip(sources, destinations):
        if is_quantized(source.dtype):
            source, destination = source.view(torch.uint8), destination.view(torch.uint8)
        src = torch.tensor([s for s, _ in pairs], device=source.device)
        dst = torch.tensor([d for _, d in pairs], device=destination.device)
        blocks = source.index_select(axis, src).to(destination.device, non_blocking=True)
        destination.index_copy_(axis, dst, blocks)
