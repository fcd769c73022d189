"""Where each module of a PEFT adapter lands in servelab's model.

PEFT names modules as the Hugging Face checkpoint does (``model.layers.0.self_attn.q_proj``);
servelab fuses some of them (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``). The
module that fuses them says where a checkpoint tensor's rows go (its ``pieces``, what the
weight loader uses): an adapter's ``B`` [out, r] is split the same way, so a part of a
fused projection lands on that part's output rows; ``A`` [r, in] reads the whole input.

Under tensor parallelism an adapter is split as its base layer is: ``pieces`` already
give this rank's ``B`` rows of a fused column-parallel layer, an unfused column-parallel
layer (the model's ``COLUMN_PARALLEL``) keeps this rank's rows of ``B``, and a row-parallel
one (``ROW_PARALLEL``) this rank's input columns of ``A``, whose partial products the
layer's all-reduce sums with the base layer's.

Under pipeline parallelism a stage keeps the modules of its own layers (renumbered as
the stage numbers them, from 0) and checks the others' shapes against its first layer,
so the driver (the first stage) refuses an adapter that another stage could not hold.
That assumes the stages' layers alike: of a model whose layers differ (DeepSeek's dense
layers before sparse ones) an adapter of the other kind of layer is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from servelab.core.errors import InvalidRequestError
from servelab.core.lora_adapter import LoRAAdapter, LoRAModule
from servelab.plugins.models.lora_linear import LoRALinear


@dataclass(frozen=True, slots=True)
class LoRAPlacement:
    """One adapted part: ``layer`` (a wrapped projection's full name) gets ``a`` [r, in]
    and ``b`` [rows, r] on its output rows from ``first_row``."""

    layer: str
    first_row: int
    a: torch.Tensor
    b: torch.Tensor


def _stage_name(model: nn.Module, name: str, adapter: LoRAAdapter) -> tuple[str, bool]:
    """``name`` as this pipeline stage numbers its layers and whether the stage holds it; a
    module of another stage's layer maps onto this stage's first layer (checked there,
    not kept)."""
    prefix, indices = getattr(model, "LAYER_PREFIX", None), getattr(model, "layer_indices", None)
    index, _, rest = name[len(prefix):].partition(".") if prefix and name.startswith(prefix) else ("", "", "")
    if indices is None or not index.isdigit():
        return name, True
    if int(index) in indices:
        return f"{prefix}{int(index) - indices.start}.{rest}", True
    if int(index) >= model.hf_config.num_hidden_layers:
        raise InvalidRequestError("target_modules", (
            f"adapter {adapter.name!r} ({adapter.path}) adapts {name!r}, past this model's "
            f"{model.hf_config.num_hidden_layers} layers (an adapter for another base model?)"))
    return f"{prefix}0.{rest}", False


def _placements(model: nn.Module, layers: dict[str, LoRALinear], module: LoRAModule,
                adapter: LoRAAdapter) -> list[LoRAPlacement]:
    name, kept = _stage_name(model, module.name, adapter)
    path, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(path)
    except AttributeError:
        parent = None
    pieces = parent.pieces(f"{child}.weight", module.b) if hasattr(parent, "pieces") else None
    if pieces is not None:
        found = [(f"{path}.{piece.param.rpartition('.')[0]}", piece.start, piece.tensor) for piece in pieces]
    else:
        found = [(name, 0, module.b)]
    parallel = getattr(model, "parallel", None)
    ranks, rank = (parallel.tp_size, parallel.tp_rank) if parallel is not None else (1, 0)
    placements = []
    for layer_name, first_row, rows in found:
        layer = layers.get(layer_name)
        if layer is None:
            raise InvalidRequestError("target_modules", (
                f"adapter {adapter.name!r} ({adapter.path}) adapts {module.name!r}, which this model does not have "
                f"as a projection servelab adapts (an adapter for another base model, or for embeddings or the "
                f"LM head?)"))
        a, in_features = module.a, layer.in_features
        if ranks > 1 and layer_name.endswith(getattr(model, "ROW_PARALLEL", ())):
            a, in_features = a[:, rank * in_features:(rank + 1) * in_features], in_features * ranks
        elif ranks > 1 and pieces is None and layer_name.endswith(getattr(model, "COLUMN_PARALLEL", ())):
            share = parallel.split(rows.shape[0])
            rows = rows[share.start:share.stop]
        whole = ranks > 1 or sum(p.shape[0] for _, _, p in found) == module.b.shape[0]
        if module.a.shape[1] != in_features or not whole or first_row + rows.shape[0] > layer.out_features:
            raise InvalidRequestError("lora_path", (
                f"adapter {adapter.name!r} ({adapter.path}): {module.name} maps {module.a.shape[1]} input features to "
                f"{module.b.shape[0]} outputs, which does not fit this model's {layer_name} ({in_features} in, "
                f"{layer.out_features} out on this device): an adapter for another base model?"))
        placements.append(LoRAPlacement(layer_name, first_row, a, rows))
    return placements if kept else []


def lora_placements(model: nn.Module, layers: dict[str, LoRALinear], adapter: LoRAAdapter) -> list[LoRAPlacement]:
    """Every part of ``adapter`` placed on ``model``'s wrapped ``layers``; raises
    ``InvalidRequestError`` naming ``target_modules`` for a module the model lacks and
    ``lora_path`` for one whose shape does not fit (an adapter for another base model)."""
    return [placement for module in adapter.modules for placement in _placements(model, layers, module, adapter)]
