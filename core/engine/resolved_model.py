"""What an engine config's model resolves to: checkpoint, implementation, device, dtypes.

The one place that turns ``cfg.model``, ``cfg.device`` and ``cfg.cache.kv_dtype`` into
torch objects: the engine resolves it once, and every parallel worker resolves the same
config the same way (``plugins/executor/device_worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from servelab.core.checkpoint import Checkpoint, load_checkpoint, resolve_device, resolve_dtype
from servelab.core.errors import ConfigError
from servelab.core.kv_cache_dtype import kv_dtype_name, resolve_kv_dtype
from servelab.core.model import ModelShape


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """``checkpoint`` (config, tokenizer, lazy weights), ``model_cls`` (the registered
    implementation of its architecture) and its ``shape``; the ``device``, the compute
    ``dtype``, the cache's element type ``kv_dtype`` and ``max_model_len``.
    ``problems``: what is wrong with ``cache.kv_dtype`` (``kv_dtype`` is then ``dtype``,
    so the engine goes on and reports every problem together)."""

    checkpoint: Checkpoint
    model_cls: type
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
        model_cls = registry.get("model", checkpoint.architecture).cls
        shape = model_cls.shape_of(checkpoint.hf_config)
        try:
            kv_dtype, problems = resolve_kv_dtype(kv_dtype_name(cfg.cache), dtype), ()
        except ConfigError as exc:
            kv_dtype, problems = dtype, tuple(exc.problems)
        return cls(checkpoint, model_cls, shape, device, dtype, kv_dtype,
                   cfg.model.max_model_len or shape.max_positions, problems)
