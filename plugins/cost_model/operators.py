"""The work of one forward pass, operator by operator: FLOPs and bytes moved on one device.

Shared by ``cost_model=roofline`` (which turns each operator into time on a roofline) and
``cost_model=profiled`` (which looks the operators up in measured tables and prices the
rest, attention above all, with the roofline). Names follow the measured tables
(Vidur's ``mlp.csv``): ``input_layernorm``, ``attn_pre_proj`` (the fused QKV projection),
``attn_rope``, ``attn_post_proj`` (the output projection), ``post_attention_layernorm``,
``mlp_up_proj`` (gate and up, fused; up alone for a plain MLP), ``mlp_act``, ``mlp_down_proj``, ``add`` (the
residual add; the other one is fused into the post-attention norm, as vLLM does), plus
``attn_prefill`` and ``attn_decode`` (attention over the KV cache), and per step ``emb``,
``final_norm``, ``lm_head`` and ``sampling``.

Under tensor parallelism of ``tp`` ranks each rank holds ``num_heads / tp`` query heads,
``max(1, num_kv_heads / tp)`` KV heads and ``intermediate_size / tp`` MLP columns; norms,
rotary embedding of the local heads and the residual add run on every rank in full width.

A latent attention (MLA, ``ModelShape.latent``) is priced in its absorbed form: the query
projection and the latent's down projection are one matmul over the hidden state, each
head's non-rotary query is taken into the latent space (``attn_pre_proj``), attention runs
over the cached latents and rotary keys, which every head shares, and each head's latent
output is taken out to its value width before the output projection (``attn_post_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from servelab.core.cost_model import BatchShape
from servelab.core.model import LatentAttention, ModelShape
from servelab.core.quantization import WeightQuantization

LINEAR_OPERATORS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
"""The decoder layer's matmuls over its linear weights: the ones ``model.quantization`` changes."""

LAYER_OPERATORS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
                   "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
"""A decoder layer's operators other than attention, in execution order."""

ATTENTION_OPERATORS = ("attn_prefill", "attn_decode")
"""Attention over the cache: requests with several new tokens (prefills, chunks,
speculative verification) and requests with one (decodes) run as two kernels."""


@dataclass(frozen=True, slots=True)
class Operator:
    """One kernel's work on one device: ``flops`` and ``bytes`` read and written."""

    name: str
    flops: float
    bytes: float


@dataclass(frozen=True, slots=True)
class Widths:
    """What one tensor-parallel rank holds of a layer: ``q_heads``, ``kv_heads`` of
    ``head_dim``, ``mlp`` columns, ``vocab`` rows of the LM head (of ``full_vocab``); and
    the element sizes of weights (``wb``), KV cache (``kvb``) and activations (``ab``);
    ``quantization``: the decoder linear layers' integer format, if any; ``gated``: the
    MLP's up projection holds gate and up columns and its activation multiplies them
    (``ModelShape.mlp_kind``); ``latent``: the layer's latent attention, if any."""

    hidden: int
    full_vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    wb: float
    kvb: float
    ab: float
    quantization: WeightQuantization | None = None
    gated: bool = True
    latent: LatentAttention | None = None

    @classmethod
    def of(cls, shape: ModelShape, tp: int, wb: float, kvb: float, ab: float,
           quantization: WeightQuantization | None = None) -> Widths:
        """The per-rank widths of ``shape`` split over ``tp`` ranks."""
        return cls(shape.hidden_size, shape.vocab_size, shape.num_heads // tp, shape.kv_heads_per_rank(tp),
                   shape.head_dim, shape.intermediate_size // tp, -(-shape.vocab_size // tp), wb, kvb, ab,
                   quantization, shape.mlp_kind == "gated", shape.latent)

    def linear_weight_bytes(self, inputs: int) -> float:
        """Bytes per weight of a decoder linear layer with ``inputs`` input features."""
        if self.quantization is None:
            return self.wb
        return self.quantization.bytes_per_weight(inputs, self.ab)

    @property
    def head_weight_bytes(self) -> float:
        """Bytes per weight the LM head reads: int8 or int4 with ``model.quantization_lm_head``."""
        if self.quantization is None or not self.quantization.lm_head:
            return self.wb
        return self.quantization.head_bytes_per_weight(self.hidden, self.ab)


def matmul(name: str, rows: int, inputs: int, outputs: int, w: Widths) -> Operator:
    """A decoder linear layer ``[rows, inputs] x [inputs, outputs]``: the weight read once
    (in its stored format), activations in and out."""
    return Operator(name, 2.0 * rows * inputs * outputs,
                    inputs * outputs * w.linear_weight_bytes(inputs) + rows * (inputs + outputs) * w.ab)


def elementwise(name: str, elements: float, reads: int, writes: int, w: Widths, flops_per_element: float = 1.0,
                weight_bytes: float = 0.0) -> Operator:
    """An operator that streams ``elements`` activations ``reads`` times in, ``writes`` out."""
    return Operator(name, flops_per_element * elements, elements * (reads + writes) * w.ab + weight_bytes)


def combined(name: str, *operators: Operator) -> Operator:
    """Several kernels priced as one operator: their FLOPs and bytes added."""
    return Operator(name, sum(op.flops for op in operators), sum(op.bytes for op in operators))


def per_head(heads: int, operator: Operator) -> Operator:
    """``operator`` run once for each of ``heads`` heads (a batched matmul)."""
    return Operator(operator.name, heads * operator.flops, heads * operator.bytes)


def attention_projections(n: int, w: Widths) -> tuple[Operator, Operator, Operator]:
    """``attn_pre_proj``, ``attn_rope`` and ``attn_post_proj`` of ``n`` new tokens: the
    fused QKV and the output projections, or a latent attention's absorbed form (module
    docstring)."""
    h, latent = w.hidden, w.latent
    if latent is None:
        rope = elementwise("attn_rope", n * (w.q_heads + w.kv_heads) * w.head_dim, 1, 1, w, 4.0)
        return (matmul("attn_pre_proj", n, h, (w.q_heads + 2 * w.kv_heads) * w.head_dim, w), rope,
                matmul("attn_post_proj", n, w.q_heads * w.head_dim, h, w))
    heads, rank, rotary = w.q_heads, latent.kv_lora_rank, latent.qk_rope_head_dim
    q_width = heads * (latent.qk_nope_head_dim + rotary)
    if latent.q_lora_rank is None:
        down = [matmul("", n, h, q_width + latent.cached_width, w)]
    else:
        down = [matmul("", n, h, latent.q_lora_rank + latent.cached_width, w),
                matmul("", n, latent.q_lora_rank, q_width, w)]
    absorb_query = per_head(heads, matmul("", n, latent.qk_nope_head_dim, rank, w))
    expand_values = per_head(heads, matmul("", n, rank, latent.v_head_dim, w))
    return (combined("attn_pre_proj", *down, absorb_query),
            elementwise("attn_rope", n * (heads + 1) * rotary, 1, 1, w, 4.0),
            combined("attn_post_proj", expand_values, matmul("", n, heads * latent.v_head_dim, h, w)))


def layer_operators(num_tokens: int, w: Widths) -> list[Operator]:
    """One decoder layer's operators but attention, for ``num_tokens`` new tokens."""
    n, h = num_tokens, w.hidden
    pre_proj, rope, post_proj = attention_projections(n, w)
    return [
        elementwise("input_layernorm", n * h, 1, 1, w, 4.0, h * w.wb),
        pre_proj,
        rope,
        post_proj,
        elementwise("post_attention_layernorm", n * h, 2, 2, w, 5.0, h * w.wb),
        matmul("mlp_up_proj", n, h, (2 if w.gated else 1) * w.mlp, w),
        elementwise("mlp_act", n * w.mlp, 2 if w.gated else 1, 1, w, 5.0 if w.gated else 4.0),
        matmul("mlp_down_proj", n, w.mlp, h, w),
        elementwise("add", n * h, 2, 1, w),
    ]


def attended_keys(query_len: int, context_len: int, window: int | None) -> int:
    """Query-key pairs of ``query_len`` new tokens ending a ``context_len``-token context,
    causal (each new token sees the cached tokens and the new ones before it) and limited
    to the last ``window`` keys when the model has a sliding window."""
    first = context_len - query_len + 1  # keys the first new token sees
    if window is None or window >= context_len:
        return query_len * first + query_len * (query_len - 1) // 2
    below = max(0, min(context_len, window) - first + 1)  # new tokens that see fewer than `window` keys
    below = min(below, query_len)
    return below * first + below * (below - 1) // 2 + (query_len - below) * window


def window_groups(shape: ModelShape, layers: Iterable[int] | None = None) -> tuple[tuple[int | None, int], ...]:
    """(window, layers) of each distinct attention window (None: the whole context) among
    ``layers`` (default: every decoder layer), in order of first appearance."""
    counts: dict[int | None, int] = {}
    for layer in range(shape.num_layers) if layers is None else layers:
        window = shape.window_of(layer)
        counts[window] = counts.get(window, 0) + 1
    return tuple(counts.items())


def attention_operators(batch: BatchShape, w: Widths, window: int | None) -> list[Operator]:
    """Attention of one layer with attention window ``window`` (None: the whole context)
    of every request over its context (FlashAttention-style: each request's K and V read
    once, Q in and the output out once), new K and V written into the cache;
    prefill-like requests (several new tokens) and decodes as two operators. A latent
    attention reads and writes each token's latent and rotary key once for all heads and
    spends, per head and query-key pair, ``kv_lora_rank + qk_rope_head_dim`` multiply-adds
    on the score and ``kv_lora_rank`` on the value."""
    if w.latent is None:
        kv_row = 2 * w.kv_heads * w.head_dim * w.kvb
        q_row = 2 * w.q_heads * w.head_dim * w.ab
        flops_per_pair = 4.0 * w.q_heads * w.head_dim
    else:
        width, rank = w.latent.cached_width, w.latent.kv_lora_rank
        kv_row = width * w.kvb
        q_row = w.q_heads * (width + rank) * w.ab
        flops_per_pair = 2.0 * w.q_heads * (width + rank)
    operators = []
    for name, decode in (("attn_prefill", False), ("attn_decode", True)):
        pairs = read = new = 0
        for q, c in zip(batch.query_lens, batch.context_lens):
            if (q == 1) != decode or q == 0:
                continue
            pairs += attended_keys(q, c, window)
            read += min(c, window + q - 1) if window else c
            new += q
        if new:
            operators.append(Operator(name, flops_per_pair * pairs, read * kv_row + new * (kv_row + q_row)))
    return operators


def first_stage_operators(num_tokens: int, w: Widths) -> list[Operator]:
    """The embedding lookup: one row of the table gathered per token."""
    return [Operator("emb", 0.0, num_tokens * w.hidden * (w.wb + w.ab))]


def last_stage_operators(num_tokens: int, num_logits_rows: int, w: Widths) -> list[Operator]:
    """The final norm, the LM head over the rows that sample (this rank's vocabulary
    slice, float32 logits) and sampling over the whole vocabulary (the logits gathered on
    one rank; softmax and the pick read them twice)."""
    rows = num_logits_rows
    if not rows:
        return [elementwise("final_norm", num_tokens * w.hidden, 1, 1, w, 4.0, w.hidden * w.wb)]
    head = Operator("lm_head", 2.0 * rows * w.hidden * w.vocab,
                    w.hidden * w.vocab * w.head_weight_bytes + rows * w.hidden * w.ab + rows * w.vocab * 4)
    sampling = Operator("sampling", 5.0 * rows * w.full_vocab, 2.0 * rows * w.full_vocab * 4)
    return [elementwise("final_norm", num_tokens * w.hidden, 1, 1, w, 4.0, w.hidden * w.wb), head, sampling]
