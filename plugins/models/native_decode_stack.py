"""A Llama-shaped decoder stack as one native call on the CPU (``decode_layers``).

At batch 1 on a small model, the Python between a decode step's ops (module calls, views,
tensor wrappers: about ten microseconds an op, a dozen ops a layer) takes as long as the
matmuls. ``NativeDecodeStack`` hands the whole layer loop of such a step to the C++ op
``torch.ops.servelab_cpu.decode_layers``, which runs the same native ops in the same order
(so the output is the same to the bit) without returning to Python between them.

On a single stage it runs a served step whole: the embedding's rows, the layers, the final
norm and, where every row needs its logits (decode steps) and the LM head has a native
kernel, the LM head (``LlamaFamilyForCausalLM.hidden_and_logits``).

It serves steps whose every request reads its context from the paged cache through
``attention=cpu`` (decode steps, chunks after a prompt's first, speculative chains; not
token trees or fresh prompts, which take the layer loop), in models whose layers are all
the plain Llama layer (``DecoderLayer`` with ``DecoderAttention``, q/k norms or not, and a
SiLU ``GatedMLP``: Llama, Mistral without a window, Qwen2, Qwen3) or its sparse twin with a
mixture of experts routed by a softmax top-k without shared experts (``SparseMoeBlock``:
Mixtral, Qwen3-MoE), on one device, with every linear layer and expert on a native kernel
and no LoRA: float32 models (linears float32, int8, w8a8, int4 or w4a8; experts float32, int8 or
w8a8), and bfloat16 models on steps of at most ``BLOCKED_BFLOAT16_ROWS`` rows, which their
Python layers multiply with ``bf16_linear`` too.
``SERVELAB_NATIVE_CPU=0`` turns it off with the other native paths.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

from servelab.kernels.cpu_ops import native_cpu_available, native_cpu_enabled
from servelab.kernels.int4_cpu import int4_linear
from servelab.kernels.quantized_cpu import int8_linear, int8_sliced_linear
from servelab.kernels.w4a8_cpu import int4_sliced_linear, w4a8_linear
from servelab.kernels.w8a8_cpu import w8a8_linear
from servelab.plugins.attention.cpu import CpuAttention, CpuMetadata
from servelab.plugins.models.linear import Linear, blocked_rows, blocked_weight_runs, is_blocked
from servelab.plugins.models.quantized_linear import QuantizedHead, QuantizedLinear

NO_TENSOR = torch.empty(0)
"""A linear's unused weight slots and missing bias."""
FLOAT, INT8, W8A8, INT4, BFLOAT16, W4A8, INT8_SLICED, INT4_SLICED = range(8)
"""``decode_layers``' linear kinds."""
QUANTIZED_KINDS = {int8_linear: INT8, w8a8_linear: W8A8, int4_linear: INT4, w4a8_linear: W4A8,
                   int8_sliced_linear: INT8_SLICED, int4_sliced_linear: INT4_SLICED}
"""The kind of a ``QuantizedLinear`` by its CPU kernel (``QuantizedLinear.kernel``)."""
VERSION = attrgetter("_version")


def _linear_slots(linear: Any, probe: torch.Tensor) -> tuple[int, list[torch.Tensor]] | None:
    """(kind, [weights..., bias]) of ``linear`` for ``decode_layers``, or None when its
    native kernel does not run for rows of ``probe``'s dtype."""
    if type(linear) is Linear and probe.dtype == torch.bfloat16:
        packed = linear.blocked_bfloat16()
        if packed is None:
            return None
        kind, tensors = BFLOAT16, [packed]
    elif type(linear) is Linear:
        packed = linear._packed_weight(probe)
        if packed is None or not is_blocked(packed):
            return None
        kind, tensors = FLOAT, [packed]
    elif type(linear) is QuantizedLinear and probe.dtype == torch.float32:
        packed = linear.packed_kernel_weights(probe)
        if packed is None:
            return None
        kind, tensors = QUANTIZED_KINDS[linear.kernel], list(packed)
    else:
        return None
    bias = linear.bias
    slots = tensors + [NO_TENSOR] * (3 - len(tensors)) + [NO_TENSOR if bias is None else bias.detach()]
    return kind, slots


def _expert_slots(stacked: Any, dtype: torch.dtype) -> tuple[int, list[torch.Tensor]] | None:
    """(kind, [weights..., no bias]) of a layer's stacked experts (``StackedWeight`` or
    ``QuantizedStackedWeight``), each tensor with the experts along its first dimension, or
    None when their native kernel does not run for rows of ``dtype``."""
    from servelab.plugins.models.moe import QuantizedStackedWeight, StackedWeight  # moe imports llama, which imports this

    if type(stacked) is StackedWeight:
        if not stacked.blocked or stacked.weight.dtype != dtype:
            return None
        kind, tensors = FLOAT if stacked.weight.dtype == torch.float32 else BFLOAT16, [stacked.stacked()]
    elif type(stacked) is QuantizedStackedWeight and dtype == torch.float32:
        packed = stacked.stacked_kernel_weights()
        if packed is None:
            return None
        kind, tensors = QUANTIZED_KINDS[stacked.layers()[0].kernel], list(packed)
    else:
        return None
    return kind, tensors + [NO_TENSOR] * (4 - len(tensors))


def _mlp_serves(mlp: Any) -> bool:
    """True for a SiLU ``GatedMLP``, or a ``SparseMoeBlock`` of SiLU experts on one device
    routed by a softmax top-k (renormalised or not, unscaled) without shared experts."""
    from servelab.plugins.models.llama import GatedMLP
    from servelab.plugins.models.moe import SparseMoeBlock

    if type(mlp) is GatedMLP:
        return mlp.fused_silu
    if type(mlp) is not SparseMoeBlock:
        return False
    routing, experts = mlp.gate.routing, mlp.experts
    return (not mlp.shared and not experts.sharded and experts.fused_silu and routing.scoring == "softmax"
            and routing.groups == 1 and routing.scale == 1.0 and not routing.correction_bias
            and not routing.float32_logits)


class NativeDecodeStack:
    """The decoder layers of one model as ``decode_layers``' arguments: per layer the two
    norms' weights, four linears (qkv, output, gate/up, down) as kind, packed tensors and
    bias, the q/k norms' weights (empty without them), and in a sparse layer the router's
    blocked weight and routed-pairs counter with the experts stacked in the gate/up and down slots;
    and the LM head's kind and tensors where ``head`` (the last stage's) has a native kernel;
    rebuilt when a parameter changes (its version or storage)."""

    def __init__(self, layers: Any, head: Any = None):
        self.layers = list(layers)
        self.head = head
        first = self.layers[0].self_attn
        self.attention, self.rotary = first.attention, first.rotary
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.eps = self.layers[0].input_layernorm.eps
        self.dtype = self.layers[0].input_layernorm.weight.dtype
        self.qk_eps = first.q_norm.eps if first.qk_norm else 0.0
        self.params = [p for layer in self.layers for p in layer.parameters()]
        self.params += [] if head is None else list(head.parameters())
        routers = [layer.mlp.gate.routing for layer in self.layers if hasattr(layer.mlp, "gate")]
        self.top_k, self.normalize = (routers[0].top_k, routers[0].normalize) if routers else (0, False)
        self.key: tuple | None = None
        self.weights: list[torch.Tensor] = []
        self.kinds: list[int] = []
        self.widths: list[int] = []
        self.head_kind, self.head_weights = 0, []

    @classmethod
    def of(cls, model: Any) -> NativeDecodeStack | None:
        """The stack of ``model``'s decoder layers, or None when it cannot serve them: see the
        module docstring for what it needs."""
        from servelab.plugins.models.llama import DecoderAttention, DecoderLayer  # llama imports this module
        from servelab.plugins.models.moe import SparseDecoderLayer

        layers = list(model.decoder_layers)
        if not layers or model.parallel.tp_size > 1 or not (native_cpu_enabled() and native_cpu_available()):
            return None
        first = layers[0].self_attn
        routings = {layer.mlp.gate.routing for layer in layers if hasattr(layer.mlp, "gate")}
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            if (type(layer) not in (DecoderLayer, SparseDecoderLayer) or type(attention) is not DecoderAttention
                    or not _mlp_serves(mlp) or len(routings) > 1 or attention.qk_norm != first.qk_norm
                    or (first.qk_norm and not attention.q_norm.eps == attention.k_norm.eps == first.q_norm.eps)
                    or attention.attention is not first.attention or attention.rotary is not first.rotary
                    or layer.input_layernorm.eps != layers[0].input_layernorm.eps
                    or layer.post_attention_layernorm.eps != layers[0].input_layernorm.eps):
                return None
        backend = first.attention
        if type(backend) is not CpuAttention or backend.spec.sliding_window is not None:
            return None
        norm = layers[0].input_layernorm.weight
        if norm.dtype not in (torch.float32, torch.bfloat16) or first.rotary.cos.dtype != norm.dtype or (
                norm.device.type != "cpu"):
            return None
        stack = cls(layers, model.lm_head if model.is_last_stage else None)
        return stack if stack._refresh() else None

    def _refresh(self) -> bool:
        """Rebuild the arguments if any parameter changed; False when a linear has no native kernel."""
        key = (tuple(map(VERSION, self.params)), tuple(map(torch.Tensor.data_ptr, self.params)))
        if key == self.key:
            return True
        probe = torch.empty(1, dtype=self.dtype)
        weights, kinds, widths = [], [], []
        for layer in self.layers:
            attention, mlp = layer.self_attn, layer.mlp
            sparse = hasattr(mlp, "gate")
            weights.append(layer.input_layernorm.weight.detach())
            linears = [_linear_slots(attention.qkv_proj, probe), _linear_slots(attention.o_proj, probe)]
            if sparse:
                experts = mlp.experts
                linears += [_expert_slots(experts.gate_up_proj, self.dtype),
                            _expert_slots(experts.down_proj, self.dtype)]
                widths += [attention.qkv_proj.out_features, attention.o_proj.out_features,
                           experts.gate_up_proj.out_features, experts.down_proj.out_features]
            else:
                linears += [_linear_slots(mlp.gate_up_proj, probe), _linear_slots(mlp.down_proj, probe)]
                widths += [linear.out_features for linear in (attention.qkv_proj, attention.o_proj,
                                                               mlp.gate_up_proj, mlp.down_proj)]
            for slots in linears:
                if slots is None:
                    return False
                kinds.append(slots[0])
                weights += slots[1]
            weights.append(layer.post_attention_layernorm.weight.detach())
            norms = (attention.q_norm.weight.detach(), attention.k_norm.weight.detach()) if attention.qk_norm else (
                NO_TENSOR, NO_TENSOR)
            weights += norms
            if sparse and not blocked_weight_runs(mlp.gate.weight):
                return False
            weights += (mlp.gate.blocked_weight(), mlp.experts.routed) if sparse else (NO_TENSOR, NO_TENSOR)
        self.key, self.weights, self.kinds, self.widths = key, weights, kinds, widths
        head = self.head.quantized() if type(self.head) is QuantizedHead else self.head
        slots = None if head is None else _linear_slots(head, probe)  # None: the head multiplies in Python
        self.head_kind, self.head_weights = slots or (0, [])
        return True

    def serves(self, rows: int, meta: Any) -> bool:
        """True when a step of ``rows`` rows (of the model's dtype) can run through the stack:
        at most ``BLOCKED_BFLOAT16_ROWS`` in bfloat16, and every request reading from the
        paged cache without a token tree."""
        return (type(meta) is CpuMetadata and not meta.fresh_starts and meta.layout.tree is None
                and blocked_rows(rows, self.dtype) and self._refresh())

    def __call__(self, state: tuple, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any) -> tuple:
        """The layers' output state (last MLP output, residual) from the first layer's input state."""
        x, residual = state
        has_residual = residual is not None
        if not has_residual:
            residual = torch.empty_like(x)
        out = self._decode_layers(x.contiguous(), residual, has_residual, positions, kv_caches, meta)
        return out, residual

    def model_hidden(self, input_ids: torch.Tensor, embedding: torch.Tensor, final_norm: Any,
                     positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                     vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole model's step in the one call: ``embedding``'s rows at ``input_ids``, the
        layers, the residual add and ``final_norm`` (an ``RMSNorm``): the LM head's input
        [T, hidden]; with ``vocab``, also every row's float32 logits [T, vocab] where the LM
        head has a native kernel (else None)."""
        logits = NO_TENSOR
        if vocab is not None and self.head_weights:
            logits = torch.empty(input_ids.shape[0], vocab)
        hidden = self._decode_layers(NO_TENSOR, NO_TENSOR, False, positions, kv_caches, meta, input_ids, embedding,
                                     final_norm.weight, final_norm.eps, logits)
        return hidden, logits if logits is not NO_TENSOR else None

    def greedy_steps(self, input_ids: torch.Tensor, embedding: torch.Tensor, final_norm: Any,
                     positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any, vocab: int,
                     steps: int) -> torch.Tensor | None:
        """``steps`` greedy decode steps of the whole model in the one call (multi-step
        decoding): each row's argmax token is fed back as its next input, one position on,
        into the slot its block table reserves. Returns the tokens [steps, T]; ``input_ids``,
        ``positions`` and the layout's slots and sequence lengths are advanced in place.
        None where the LM head has no native kernel."""
        if not self.head_weights:
            return None
        tokens = torch.empty(steps, input_ids.shape[0], dtype=torch.long)
        self._decode_layers(NO_TENSOR, NO_TENSOR, False, positions, kv_caches, meta, input_ids, embedding,
                            final_norm.weight, final_norm.eps, torch.empty(input_ids.shape[0], vocab), tokens)
        return tokens

    def _decode_layers(self, hidden: torch.Tensor, residual: torch.Tensor, has_residual: bool,
                       positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                       input_ids: torch.Tensor = NO_TENSOR, embedding: torch.Tensor = NO_TENSOR,
                       final_norm: torch.Tensor = NO_TENSOR, final_eps: float = 0.0,
                       logits: torch.Tensor = NO_TENSOR, step_tokens: torch.Tensor = NO_TENSOR) -> torch.Tensor:
        layout = meta.layout
        head = self.head_weights if logits is not NO_TENSOR else []
        return torch.ops.servelab_cpu.decode_layers(
            hidden, residual, has_residual, positions, kv_caches, layout.slot_mapping, layout.block_table,
            layout.query_start_loc, layout.seq_lens, meta.cached, self.rotary.cos, self.rotary.sin,
            self.rotary.rotary_dim, self.weights, self.kinds, self.widths, self.num_heads, self.num_kv_heads,
            self.head_dim, self.attention.spec.scale, self.eps, self.qk_eps, self.top_k, self.normalize, input_ids,
            embedding, final_norm, final_eps, logits, head, self.head_kind, step_tokens, layout.block_size)
