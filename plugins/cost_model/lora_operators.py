"""LoRA adapters' work on one device: the low-rank matmuls a step adds, an adapter's bytes
(what a load copies from host memory into a slot) and merging one into the base weights.

A step applies its adapters Punica-style (S-LoRA's and servelab's Triton kernel): per
adapted projection one *shrink* launch (``x A^T``, every adapter's tokens against its
own ``A``) and one *expand* launch (``+= (x A^T) B^T``), each adapter's ``A`` and ``B``
read once per step whatever its number of tokens. An adapter of rank r on a projection of
``inputs`` x ``outputs`` features costs each of its tokens ``2 r (inputs + outputs)``
FLOPs and reads ``r (inputs + outputs)`` weights once per step.

Under tensor parallelism an adapter is split as its base layer: a column-parallel
projection (q, k, v, gate, up) keeps its whole ``A`` and its rows of ``B`` on every rank,
a row-parallel one (o, down) its input columns of ``A`` and the whole ``B``; the
``Widths`` of one rank give exactly those features.
"""

from __future__ import annotations

from servelab.core.cost_model import AdapterWork
from servelab.plugins.cost_model.operators import Operator, Widths

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
"""The decoder projections an adapter can adapt, by their Hugging Face names."""


def projection_features(name: str, w: Widths) -> tuple[int, int]:
    """(inputs, outputs) of projection ``name`` on one tensor-parallel rank; ``ValueError``
    for a name that is not a projection of this layer shape (q/k/v of a latent attention,
    gate/up of a plain MLP)."""
    q, kv = w.q_heads * w.head_dim, w.kv_heads * w.head_dim
    features = {"o_proj": (q, w.hidden), "up_proj": (w.hidden, w.mlp), "down_proj": (w.mlp, w.hidden)}
    if w.latent is None:
        features.update(q_proj=(w.hidden, q), k_proj=(w.hidden, kv), v_proj=(w.hidden, kv))
    if w.gated:
        features["gate_proj"] = (w.hidden, w.mlp)
    if name not in features:
        raise ValueError(f"{name!r} is not a projection of this model's decoder layers (it has "
                         f"{', '.join(sorted(features))})")
    return features[name]


def lora_operators(adapters: tuple[AdapterWork, ...], w: Widths) -> list[Operator]:
    """One decoder layer's adapter work: ``lora_shrink`` and ``lora_expand`` of every
    projection some adapter in the step adapts, over all of its adapters at once."""
    operators = []
    for name in PROJECTIONS:
        mine = [a for a in adapters if name in a.projections and a.tokens]
        if not mine:
            continue
        inputs, outputs = projection_features(name, w)
        tokens = sum(a.tokens for a in mine)
        rows = sum(a.tokens * a.rank for a in mine)  # low-rank activations written then read
        weights = sum(a.rank for a in mine) * w.wb
        operators.append(Operator("lora_shrink", 2.0 * rows * inputs,
                                  weights * inputs + (tokens * inputs + rows) * w.ab))
        operators.append(Operator("lora_expand", 2.0 * rows * outputs,
                                  weights * outputs + (rows + 2 * tokens * outputs) * w.ab))
    return operators


def adapter_bytes(rank: int, projections: tuple[str, ...], w: Widths, num_layers: int) -> float:
    """Bytes one rank holds of an adapter of ``rank`` on ``projections`` in ``num_layers``
    layers: its ``A`` and ``B`` at the weights' element size."""
    return num_layers * sum(rank * sum(projection_features(name, w)) * w.wb for name in projections)


def merge_operators(rank: int, projections: tuple[str, ...], w: Widths) -> list[Operator]:
    """Adding one adapter into one layer's base weights (``W += B A``; removing it again
    costs the same): per projection the product's FLOPs, the base weight read and written
    and the adapter read. One ``lora_merge`` operator per projection."""
    operators = []
    for name in projections:
        inputs, outputs = projection_features(name, w)
        operators.append(Operator("lora_merge", 2.0 * rank * inputs * outputs,
                                  2 * inputs * outputs * w.wb + rank * (inputs + outputs) * w.wb))
    return operators
