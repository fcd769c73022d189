"""What an engine config's model resolves to: checkpoint, implementation, device, dtypes.

The one place that turns ``cfg.model``, ``cfg.device`` and ``cfg.cache.kv_dtype`` into
torch objects: the engine resolves it once, and every parallel worker resolves the same
config the same way (``plugins/executor/device_worker.py``).

The registered implementation of the architecture reads the model's shape from its
transformers config (a checkpoint's, or the one built from ``model.shape``). A
weightless ``model.shape`` of an architecture servelab has no implementation of, or whose
implementation's shape has no ``experts`` where the sizes give some (it prices the MLP
otherwise), is read from its sizes instead (``shape_config.model_shape_of``):
``executor=simulated`` prices it, ``executor=model`` refuses it for having no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from servelab.core.checkpoint import Checkpoint, load_checkpoint, resolve_device, resolve_dtype
from servelab.core.errors import ConfigError
from servelab.core.kv_cache_dtype import kv_dtype_name, resolve_kv_dtype
from servelab.core.model import ModelShape
from servelab.core.shape_config import layer_windows_of, model_shape_of, simulated_routing


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """``checkpoint`` (config, tokenizer, lazy weights), ``model_cls`` (the registered
    implementation of its architecture; None for a weightless shape read from its sizes)
    and its ``shape``; the ``device``, the compute
    ``dtype``, the cache's element type ``kv_dtype`` and ``max_model_len``.
    ``problems``: what is wrong with ``cache.kv_dtype`` (``kv_dtype`` is then ``dtype``,
    so the engine goes on and reports every problem together)."""

    checkpoint: Checkpoint
    model_cls: type | None
    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    problems: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: Any, registry: Any, runs_model: bool = True) -> "ResolvedModel":
        """Resolve the engine config ``cfg``'s model with the implementations of
        ``registry``; ``runs_model``: whether an executor will run it (``model.dtype=auto``
        is float32 on a CPU that does)."""
        checkpoint = load_checkpoint(cfg.model)
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.model.dtype, checkpoint.hf_config, device, runs_model)
        sizes = cfg.model.shape
        problems: tuple[str, ...] = ()
        weightless = sizes is not None and checkpoint.weights is None
        implemented = checkpoint.architecture in registry.specs("model")
        model_cls = registry.get("model", checkpoint.architecture).cls if implemented or not weightless else None
        shape = None if model_cls is None else model_cls.shape_of(checkpoint.hf_config)
        from_sizes = weightless and (shape is None or (sizes.experts is not None and shape.experts is None))
        if shape is not None and sizes is not None:  # read from the sizes or not, the other fields must agree
            problems = tuple(unread_sizes(sizes, shape, checkpoint.architecture, experts=not from_sizes))
        if from_sizes:
            model_cls, shape = None, model_shape_of(sizes, checkpoint.hf_config.vocab_size)
        elif sizes is not None and sizes.experts is not None and shape.experts is not None:
            shape = simulated_routing(shape, sizes.experts)  # routing no architecture's config holds
        try:
            kv_dtype = resolve_kv_dtype(kv_dtype_name(cfg.cache), dtype)
        except ConfigError as exc:
            kv_dtype, problems = dtype, problems + tuple(exc.problems)
        return cls(checkpoint, model_cls, shape, device, dtype, kv_dtype,
                   cfg.model.max_model_len or shape.max_positions, problems)


def unread_sizes(sizes: Any, shape: ModelShape, architecture: str, experts: bool = True) -> list[str]:
    """The parts of a ``model.shape`` that the implementation of ``architecture`` read
    otherwise or not at all (its ``shape``), each naming its field; ``experts``: whether
    a mixture of experts its shape lacks is one (not when the sizes give it instead)."""
    problems = []
    read = tuple(None if w is None or w >= shape.max_positions else w
                 for w in map(shape.window_of, range(shape.num_layers)))
    if read != layer_windows_of(sizes):
        problems.append(f"model.shape.sliding_window and window_pattern: {architecture}'s servelab implementation "
                        f"reads other windows from its config (layer 0: {read[0]}; the shape's: "
                        f"{layer_windows_of(sizes)[0]})")
    if sizes.latent is not None and shape.latent is None:
        problems.append(f"model.shape.latent: {architecture}'s servelab implementation has no latent attention")
    if sizes.latent is None and shape.latent is not None:
        problems.append(f"model.shape.latent=null: {architecture}'s servelab implementation always runs latent "
                        f"attention (its config's kv_lora_rank={shape.latent.kv_lora_rank})")
    if experts and sizes.experts is not None and shape.experts is None:
        problems.append(f"model.shape.experts: {architecture}'s servelab implementation has no mixture of experts")
    return problems
