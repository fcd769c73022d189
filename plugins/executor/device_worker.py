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
from servelab.core.kv_cache_dtype import is_quantized
from servelab.core.model import CausalLM, ModelParallel
from servelab.core.engine.resolved_model import ResolvedModel
from servelab.platform import huge_page_zeros
from servelab.plugins.models.quantized_linear import quantize_linears


class DeviceWorker:
    """One device's model, attention backend and KV cache tensors (``kv_caches`` on the
    device, ``host_caches`` for swapping)."""

    def __init__(self, model: Any, attention: Any, dtype: torch.dtype, device: torch.device, parallel: ModelParallel,
                 num_layers: int):
        self.model = model
        self.num_layers = num_layers
        self.attention = attention
        self.dtype = dtype
        self.device = device
        self.parallel = parallel
        self.kv_caches: list[torch.Tensor] = []
        self.host_caches: list[torch.Tensor] = []

    @classmethod
    def load(cls, registry: Any, model: ResolvedModel, attention_config: Any,
             parallel: ModelParallel = ModelParallel()) -> "DeviceWorker":
        """Load ``model``'s weights (``parallel``'s share of them) with the attention backend
        of ``attention_config`` built from ``registry``."""
        spec = model.shape.attention_spec(model.dtype, model.device, model.max_model_len, parallel.tp_size,
                                          model.kv_dtype)
        attention = registry.build("attention", attention_config, spec)
        network = load_model(model.checkpoint, model.model_cls, attention, model.dtype, model.max_model_len, parallel)
        return cls(network.to(model.device).eval(), attention, model.dtype, model.device, parallel,
                   len(parallel.layer_range(model.shape.num_layers)))

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

    def allocate(self, num_blocks: int, block_size: int, host_blocks: int = 0) -> None:
        """KV tensors for this stage's ``num_layers`` layers (and the host pool's, for swapping)."""
        layers = self.num_layers
        dtype = self.attention.spec.cache_dtype
        shape = self.attention.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [huge_page_zeros(shape, dtype, self.device) for _ in range(layers)]
        host = self.attention.kv_cache_shape(host_blocks, block_size)
        self.host_caches = [torch.zeros(host, dtype=dtype) for _ in range(layers if host_blocks else 0)]

    def move_blocks(self, moves: tuple) -> None:
        """Swap in, swap out, then copy-on-write. Swapping in first reads every host block
        before a swap-out of the same step may reuse it (the cache frees a swapped-in
        request's host blocks at once); a swap-in's device blocks were taken before any
        swap-out of the step released its own, and copies write fresh blocks last."""
        swap_out, copy, swap_in = moves
        copy_blocks(self.attention, self.host_caches, self.kv_caches, swap_in)
        copy_blocks(self.attention, self.kv_caches, self.host_caches, swap_out)
        copy_blocks(self.attention, self.kv_caches, self.kv_caches, copy)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
                carried: tuple | None = None) -> Any:
        """This stage's layers over the step: hidden states [T, hidden] on the last stage,
        else the (output, residual) pair the next stage carries on with."""
        meta = self.attention.build_metadata(layout)
        return self.model(input_ids, positions, self.kv_caches, meta, carried)

    @torch.inference_mode()
    def logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """The whole model over one step's ``inputs`` on this device: float32 logits
        [N, vocab] at ``inputs.logits_indices`` (None when no row needs them)."""
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.layout)
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def release(self) -> None:
        """Drop the model, the attention backend and the KV tensors."""
        self.model = self.attention = None
        self.kv_caches, self.host_caches = [], []


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
