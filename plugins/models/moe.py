"""The sparse mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE) and the decoder
layer and causal LM that use it in place of some or all of Llama's dense MLPs.

A router (``gate``, [experts, hidden], whole on every rank) scores every token and picks
its ``num_experts_per_tok`` experts and their weights as ``routing.py`` says for each
family (Mixtral's and Qwen's top-k of a softmax, DeepSeek's grouped and biased top-k). The experts run fused: the step's (token,
choice) pairs are sorted by expert, each expert that has any multiplies its packed rows at
once (gate and up in one matmul, then down), the outputs are scaled by their weights and
added back onto their tokens with one ``index_add_``; no Python loop over tokens. Qwen2-MoE
adds a shared expert that every token passes, scaled by ``sigmoid(shared_expert_gate(x))``;
DeepSeek's shared experts (``n_shared_experts`` of ``moe_intermediate_size``, run as one MLP
of their summed width) are added ungated.
On a CUDA device with triton installed the experts run instead as the Triton grouped GEMM
of ``servelab/kernels/fused_moe.py`` (pairs aligned to whole tiles per expert, one launch
for gate/up and one for down, the activation between them in torch); elsewhere as above.

Expert weights are stacked, one tensor per projection and layer (``StackedWeight``). The
loader takes what transformers' ``save_pretrained`` writes (per-expert
``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's ``w1`` / ``w3`` / ``w2``) and
the fused 3-D ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] of
transformers' own modules. Tensor parallelism splits every expert's intermediate size
(gate/up rows, down columns) and the shared expert's like a dense MLP; the block sums its
ranks with one all-reduce. Expert parallelism (``parallel.expert_parallel_size`` equal to
the tensor-parallel size) gives each tensor-parallel rank 1/N of the routed experts whole
instead: every rank has every token's hidden state already, computes the pairs routed to
its experts, and the same all-reduce combines them (no all-to-all: the tokens never leave).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from servelab.core.errors import ConfigError
from servelab.core.model import MixtureOfExperts, ModelParallel, ModelShape
from servelab.core.quantization import WeightQuantization
from servelab.kernels.availability import triton_unavailable_reason
from servelab.kernels.blocked_linear import float_linear, pack_blocks
from servelab.kernels.quantized_cpu import int8_sliced_linear
from servelab.kernels.quantized_weights import quantize_int8
from servelab.plugins.models.decoder import WeightPiece, use_native
from servelab.plugins.models.linear import Linear
from servelab.plugins.models.quantized_linear import QuantizedLinear
from servelab.plugins.models.llama import (DecoderLayer, GatedMLP, LlamaFamilyForCausalLM, activation_of,
                                           gated_activation)
from servelab.plugins.models.routing import Router, Routing, checked

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The per-expert projections a checkpoint names."""
NO_SCALES = torch.empty(0)
"""``grouped_expert_linear``'s scales for float32 experts."""
ExpertGroups = tuple[list[int], list[int], list[int]]
"""A step's pairs sorted by expert as groups: the experts with pairs, where each one's rows
start, how many there are."""


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """A config's mixture of experts: ``num_experts`` routed experts of ``intermediate_size``
    each (``width_field`` names that size in the config, ``experts_field`` the count), each
    token's chosen as ``routing`` says; shared experts of ``shared_intermediate_size``
    together (0: none; ``shared_field`` names that size), behind a sigmoid gate when
    ``shared_gated``; the mixture in the layers ``sparse_layers``, the other layers dense."""

    num_experts: int
    routing: Routing
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    shared_gated: bool = True
    experts_field: str = "num_experts"
    width_field: str = "moe_intermediate_size"
    shared_field: str = "shared_expert_intermediate_size"

    @property
    def top_k(self) -> int:
        """Experts chosen per token."""
        return self.routing.top_k

    @classmethod
    def of(cls, hf_config: Any) -> ExpertLayout:
        """Read from Mixtral's names (``num_local_experts``, ``intermediate_size``, every layer
        sparse, always renormalised), Qwen-MoE's (``num_experts``, ``moe_intermediate_size``,
        ``norm_topk_prob``, ``shared_expert_intermediate_size``, dense layers from
        ``mlp_only_layers`` and ``decoder_sparse_step``) or DeepSeek-V2/V3's
        (``deepseek_layout``); a routing that cannot run (a ``top_k`` outside [1, experts],
        groups that do not divide the experts) is a ``ConfigError`` naming the fields."""
        layers = hf_config.num_hidden_layers
        if hf_config.model_type in ("deepseek_v2", "deepseek_v3"):
            layout = deepseek_layout(hf_config)
        elif hf_config.model_type == "mixtral":
            layout = cls(hf_config.num_local_experts, Routing(hf_config.num_experts_per_tok, True),
                         hf_config.intermediate_size, tuple(range(layers)), 0, True, "num_local_experts",
                         "intermediate_size")
        else:
            dense, step = set(hf_config.mlp_only_layers or ()), hf_config.decoder_sparse_step
            sparse = tuple(i for i in range(layers) if i not in dense and hf_config.num_experts > 0
                           and (i + 1) % step == 0)
            layout = cls(hf_config.num_experts, Routing(hf_config.num_experts_per_tok, bool(hf_config.norm_topk_prob)),
                         hf_config.moe_intermediate_size, sparse,
                         getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        if layout.sparse_layers:
            checked(layout.routing, layout.num_experts, layout.experts_field)
        return layout

    def priced(self, dense: ModelShape) -> ModelShape:
        """``dense`` (whose ``intermediate_size`` is the dense layers') with its mixture of
        experts (``ModelShape.experts``), which the cost models price expert by expert;
        ``dense`` itself when no layer is sparse."""
        if not self.sparse_layers:
            return dense
        dense_layers = tuple(layer for layer in range(dense.num_layers) if layer not in self.sparse_layers)
        return replace(dense, experts=MixtureOfExperts(self.num_experts, self.top_k, self.intermediate_size,
                                                       self.shared_intermediate_size, dense_layers,
                                                       shared_gate=self.shared_gated and bool(self.shared_intermediate_size)))

    def split_problems(self, tensor_parallel_size: int, dense_intermediate_size: int, num_layers: int,
                       expert_parallel: bool = False) -> list[str]:
        """Why tensor parallelism cannot split the experts (their width; under
        ``expert_parallel``, their count), the shared expert or the dense layers' MLP
        ``tensor_parallel_size`` ways (empty when it can)."""
        if expert_parallel:
            widths = [(f"routed experts' count {self.experts_field}", self.num_experts)]
        else:
            widths = [(f"experts' {self.width_field}", self.intermediate_size)] if self.sparse_layers else []
        if self.sparse_layers and self.shared_intermediate_size:
            widths.append((f"shared expert's {self.shared_field}", self.shared_intermediate_size))
        if len(self.sparse_layers) < num_layers:
            widths.append(("dense layers' intermediate_size", dense_intermediate_size))
        return [f"parallel.tensor_parallel_size={tensor_parallel_size} does not divide the {field} {size}"
                for field, size in widths if size % tensor_parallel_size]


def deepseek_layout(hf_config: Any) -> ExpertLayout:
    """DeepSeek-V2/V3's mixture: ``n_routed_experts`` of ``moe_intermediate_size`` in the
    layers from ``first_k_dense_replace`` on, ``n_shared_experts`` of the same width run as
    one ungated MLP; V2 routes by softmax, greedy or (``topk_method=group_limited_greedy``)
    within the best ``topk_group`` of ``n_group`` groups; V3 by sigmoid scores with the
    correction bias, within the groups whose two best experts add up highest, renormalised
    with ``norm_topk_prob``; both scale the weights by ``routed_scaling_factor``. Another
    ``topk_method`` is a ``ConfigError`` naming it."""
    layers = hf_config.num_hidden_layers
    sparse = tuple(range(min(hf_config.first_k_dense_replace or 0, layers), layers))
    groups, top_groups = hf_config.n_group or 1, hf_config.topk_group or 1
    top_k, scale = hf_config.num_experts_per_tok or 0, float(hf_config.routed_scaling_factor)
    if hf_config.model_type == "deepseek_v3":
        routing = Routing(top_k, bool(hf_config.norm_topk_prob), "sigmoid", groups, top_groups, "top2_sum", scale,
                          float32_logits=True, correction_bias=True)
    elif hf_config.topk_method in ("greedy", "group_limited_greedy"):
        grouped = hf_config.topk_method == "group_limited_greedy"
        routing = Routing(top_k, False, "softmax", groups if grouped else 1, top_groups if grouped else 1, "max",
                          scale, float32_logits=True)
    else:
        raise ConfigError([f"topk_method={hf_config.topk_method!r} is not supported; supported: greedy, "
                           f"group_limited_greedy"])
    return ExpertLayout(hf_config.n_routed_experts, routing, hf_config.moe_intermediate_size, sparse,
                        (hf_config.n_shared_experts or 0) * hf_config.moe_intermediate_size, False, "n_routed_experts",
                        "moe_intermediate_size", "n_shared_experts x moe_intermediate_size")


GROUPED_BFLOAT16_ROWS = 64
"""bfloat16 experts multiply through ``grouped_expert_linear`` (every expert in one native
call, no weight reorder) when no expert has more rows than this, else with oneDNN one
expert at a time (its bfloat16 instructions pay off on long prefills). At least
``BLOCKED_BFLOAT16_ROWS``: the native decoder stack's bfloat16 steps take the grouped call
in Python too. On the offline workload of the 0.46B Qwen3-MoE shape (256 sequences, about
21 rows an expert in a decode step) 64 gave 1102 tokens/s, 16 gave 939."""


class StackedWeight(nn.Module):
    """``experts`` matrices [out_features, in_features] in one parameter ``weight`` [experts *
    out_features, in_features] (expert e's rows from e * out_features), multiplied one expert
    at a time: on the CPU with the native ops through a blocked copy of each expert packed
    once (rebuilt when the weight changes; one more weight's memory, as ``Linear``'s),
    float32 for ``float_linear``, bfloat16 for ``grouped_expert_linear`` on steps whose
    experts have at most ``GROUPED_BFLOAT16_ROWS`` rows each, else ``F.linear`` on the
    expert's rows."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.experts, self.out_features = experts, out_features
        self.weight = nn.Parameter(torch.empty(experts * out_features, in_features))
        self._packed: tuple[tuple, torch.Tensor, list[torch.Tensor]] | None = None

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index``'s matrix [out_features, in_features] (a view)."""
        return self.weight[index * self.out_features:(index + 1) * self.out_features]

    @property
    def blocked(self) -> bool:
        """True where the experts have a blocked copy (float32 or bfloat16 on the CPU with
        the native ops built)."""
        return self.weight.dtype in (torch.float32, torch.bfloat16) and use_native(self.weight)

    def packed(self) -> list[torch.Tensor]:
        """Every expert's matrix in ``float_linear``'s blocked layout (packed on first use;
        views of ``stacked``)."""
        return self._packed_now()[2]

    def stacked(self) -> torch.Tensor:
        """Every expert's blocked matrix stacked: [experts, N' / 16, K, 16]."""
        return self._packed_now()[1]

    def _packed_now(self) -> tuple[tuple, torch.Tensor, list[torch.Tensor]]:
        weight = self.weight
        key = (weight._version, weight.data_ptr())
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # free the old copy before packing the new one
            with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
                stacked = torch.stack([pack_blocks(self.expert(e)) for e in range(self.experts)])
            self._packed = (key, stacked, list(stacked.unbind(0)))
        return self._packed

    def matmul(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """x: [N, in_features] -> x @ expert(index).T [N, out_features]."""
        if x.dtype == self.weight.dtype == torch.float32 and self.blocked:
            return float_linear(x.contiguous(), self.packed()[index], self.out_features)
        return F.linear(x, self.expert(index))

    def grouped(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor | None:
        """Each group's rows of ``x`` (the weight's dtype) times its expert's matrix, in one
        native call (``grouped_expert_linear``); None where the experts do not multiply
        natively (bfloat16: an expert with more than ``GROUPED_BFLOAT16_ROWS`` rows)."""
        if x.dtype != self.weight.dtype or not self.blocked or (
                x.dtype == torch.bfloat16 and max(groups[2]) > GROUPED_BFLOAT16_ROWS):
            return None
        out = x.new_empty(x.shape[0], self.out_features)
        torch.ops.servelab_cpu.grouped_expert_linear(out, x.contiguous(), self.stacked(), NO_SCALES, *groups)
        return out


class QuantizedStackedWeight(nn.Module):
    """``experts`` matrices [out_features, in_features] in int8 with one scale per row,
    stacked as ``StackedWeight`` stacks them: ``qweight`` [experts * out_features,
    in_features] and ``scales`` [experts * out_features] (in the activations' dtype), as
    ``quantize_int8`` gives them. Each expert multiplies as a ``QuantizedLinear`` over views
    of its rows (the int8 CPU kernel, w8a8's with ``int8_activations``, the Triton kernel on
    CUDA), built on first use and again when the tensors move."""

    def __init__(self, experts: int, out_features: int, in_features: int, dtype: torch.dtype,
                 int8_activations: bool):
        super().__init__()
        self.experts, self.out_features, self.in_features = experts, out_features, in_features
        self.int8_activations = int8_activations
        self.qweight = nn.Parameter(torch.zeros(experts * out_features, in_features, dtype=torch.int8),
                                    requires_grad=False)
        self.scales = nn.Parameter(torch.ones(experts * out_features, dtype=dtype), requires_grad=False)
        self._layers: tuple[tuple, list[QuantizedLinear]] | None = None
        self._stacked: tuple[tuple, tuple[torch.Tensor, ...] | None] | None = None

    def layers(self) -> list[QuantizedLinear]:
        """One ``QuantizedLinear`` per expert over views of its rows."""
        key = (self.qweight.data_ptr(), self.scales.data_ptr())
        if self._layers is None or self._layers[0] != key:
            layers = []
            with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
                for e in range(self.experts):
                    rows = slice(e * self.out_features, (e + 1) * self.out_features)
                    layer = QuantizedLinear(self.in_features, self.out_features, False, 8, -1, self.scales.dtype,
                                            self.int8_activations)
                    layer.qweight = nn.Parameter(self.qweight[rows], requires_grad=False)
                    layer.scales = nn.Parameter(self.scales[rows], requires_grad=False)
                    layers.append(layer)
            self._layers = (key, layers)
        return self._layers[1]

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index``'s matrix [out_features, in_features], dequantized."""
        return self.layers()[index].dequantized_weight()

    def pack(self) -> None:
        """Pack every expert for its CPU kernel now (else on first use)."""
        self.stacked_kernel_weights()

    def stacked_kernel_weights(self) -> tuple[torch.Tensor, ...] | None:
        """Every expert's CPU kernel tensors (``QuantizedLinear.packed_kernel_weights``)
        stacked along a first dimension, the experts' layers then multiplying with views of
        them (no second copy); None where the kernel does not run."""
        qweight, scales = self.qweight, self.scales
        key = (qweight._version, qweight.data_ptr(), scales._version, scales.data_ptr())
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = None  # free the old stack before packing the new one
            layers = self.layers()
            packs = [layer.packed_kernel_weights(scales.new_empty(0)) for layer in layers]
            stacked = None
            if all(pack is not None for pack in packs):
                with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
                    stacked = tuple(torch.stack(parts) for parts in zip(*packs))
                for index, layer in enumerate(layers):
                    layer.share_packed(tuple(tensor[index] for tensor in stacked))
            self._stacked = (key, stacked)
        return self._stacked[1]

    def matmul(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """x: [N, in_features] -> x @ expert(index).T [N, out_features]."""
        return self.layers()[index](x)

    def grouped(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor | None:
        """Each group's rows of float32 ``x`` times its expert's matrix, in one native call
        (``grouped_expert_linear``, ``grouped_int8_sliced_linear`` where the experts'
        ``QuantizedLinear`` layers slice their rows, or with int8 activations
        ``grouped_w8a8_linear``);
        None where the experts' CPU kernel does not run."""
        if x.dtype != torch.float32 or self.scales.dtype != torch.float32 or x.device.type != "cpu":
            return None
        stacked = self.stacked_kernel_weights()
        if stacked is None:
            return None
        out = x.new_empty(x.shape[0], self.out_features)
        if self.int8_activations:
            torch.ops.servelab_cpu.grouped_w8a8_linear(out, x.contiguous(), *stacked, *groups)
        elif self.layers()[0].kernel is int8_sliced_linear:
            torch.ops.servelab_cpu.grouped_int8_sliced_linear(out, x.contiguous(), *stacked, *groups)
        else:
            torch.ops.servelab_cpu.grouped_expert_linear(out, x.contiguous(), *stacked, *groups)
        return out


class ExpertWeights(nn.Module):
    """Layer ``layer``'s routed experts this rank holds (``held``: all of them, or under
    expert parallelism its share, whole), this rank's ``columns`` of each one's
    intermediate size (all of them under expert parallelism): ``gate_up_proj`` [E * 2 * I,
    hidden] ([gate | up] per held expert) and ``down_proj`` [E * hidden, I]; ``loaded``
    records which checkpoint tensors arrived; ``routed`` counts the pairs routed to each
    of the layer's experts (on every rank: each routes every token, or under ``all_to_all``
    dispatch the ranks share their counts)."""

    def __init__(self, layout: ExpertLayout, hidden_size: int, parallel: ModelParallel, layer: int, act: Any,
                 fused_silu: bool):
        super().__init__()
        self.held = parallel.expert_range(layout.num_experts)
        self.sharded = parallel.expert_parallel
        self.total_experts, self.num_experts = layout.num_experts, len(self.held)
        self.hidden_size, self.layer = hidden_size, layer
        self.columns = range(layout.intermediate_size) if self.sharded else parallel.split(layout.intermediate_size)
        self.intermediate = len(self.columns)
        self.gate_up_proj = StackedWeight(self.num_experts, 2 * self.intermediate, hidden_size)
        self.down_proj = StackedWeight(self.num_experts, hidden_size, self.intermediate)
        self.act, self.fused_silu = act, fused_silu
        self.quantized = False
        self.loaded: set[tuple[int, str]] = set()
        self.register_buffer("routed", torch.zeros(layout.num_experts, dtype=torch.int64), persistent=False)

    def quantize_weights(self, quantization: WeightQuantization) -> None:
        """Store the experts in int8 (``QuantizedStackedWeight``; with w8a8's int8
        activations when ``quantization`` asks); other bit widths are a ``ConfigError``."""
        if quantization.bits != 8:
            raise ConfigError([f"model.quantization: a mixture's experts are quantized to 8 bits only (int8 or w8a8), "
                               f"not {quantization.bits}"])
        weight = self.gate_up_proj.weight
        self.gate_up_proj = QuantizedStackedWeight(self.num_experts, 2 * self.intermediate, self.hidden_size,
                                                   weight.dtype, quantization.int8_activations).to(weight.device)
        self.down_proj = QuantizedStackedWeight(self.num_experts, self.hidden_size, self.intermediate, weight.dtype,
                                                quantization.int8_activations).to(weight.device)
        self.quantized = True

    def fused_counts(self) -> dict[str, int]:
        """gate_up_proj waits for a gate and an up piece per expert, down_proj for one per expert."""
        return {"gate_up_proj": 2 * self.num_experts, "down_proj": self.num_experts}

    def pieces(self, leaf: str, tensor: torch.Tensor) -> list[WeightPiece] | None:
        """This rank's pieces of one expert's projection (``leaf``: ``gate_proj.3``, as
        ``checkpoint_names`` renames ``experts.3.gate_proj.weight``; ``gate_proj:qweight.3``
        and ``gate_proj:scales.3`` for a quantized checkpoint's) or of every expert's
        stacked one (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
        part, _, index = leaf.partition(".")
        projection, _, kind = part.partition(":")
        if projection in PROJECTIONS and index.isdigit():
            return self._expert_pieces(int(index), projection, tensor, kind or "weight")
        if part == "gate_up_proj" and not index:
            return [piece for e in range(self.total_experts) for half, part in zip(tensor[e].chunk(2), PROJECTIONS)
                    for piece in self._expert_pieces(e, part, half)]
        if part == "down_proj" and not index:
            return [piece for e in range(self.total_experts) for piece in self._expert_pieces(e, part, tensor[e])]
        return None

    def _expert_pieces(self, expert: int, part: str, tensor: torch.Tensor, kind: str = "weight") -> list[WeightPiece]:
        """Expert ``expert``'s (a checkpoint index) piece of ``part``'s ``kind`` (weight,
        qweight or scales); none for an expert another rank holds. A float weight of
        experts stored in int8 is quantized here, its rows whole before any column split."""
        if kind != "scales":
            self.loaded.add((expert, part))
        if expert not in self.held:
            return []
        expert -= self.held.start
        if kind == "weight" and self.quantized:
            qweight, scales = quantize_int8(tensor)
            return self._rows(expert, part, qweight, "qweight") + self._rows(expert, part, scales, "scales")
        return self._rows(expert, part, tensor, kind)

    def _rows(self, expert: int, part: str, tensor: torch.Tensor, kind: str) -> list[WeightPiece]:
        """This rank's expert ``expert``'s rows of ``part`` in the stacked parameter
        ``kind``: its columns of gate and up, its input columns of down (a row's scale
        covers every column)."""
        columns = slice(self.columns.start, self.columns.stop)
        if part == "down_proj":
            rows = tensor if kind == "scales" else tensor[:, columns]
            return [WeightPiece(f"down_proj.{kind}", expert * self.hidden_size, rows)]
        start = expert * 2 * self.intermediate + (self.intermediate if part == "up_proj" else 0)
        return [WeightPiece(f"gate_up_proj.{kind}", start, tensor[columns])]

    def missing(self) -> list[str]:
        """The (layer, expert, projection) tensors the checkpoint did not give."""
        return [f"layer {self.layer} expert {e} {part}" for e in range(self.total_experts) for part in PROJECTIONS
                if (e, part) not in self.loaded]

    def fused_kernel_runs(self) -> bool:
        """True when ``fused`` can run these experts: float, or int8 with float activations."""
        return not (self.quantized and self.gate_up_proj.int8_activations)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``forward``'s result through the Triton ``fused_moe`` kernel (int8 experts
        multiplied as stored, with their row scales; under expert parallelism this rank's
        experts only)."""
        from servelab.kernels.fused_moe import fused_moe

        stacked = (self.gate_up_proj, self.down_proj)
        if self.quantized:
            matrices = tuple(w.qweight.unflatten(0, (self.num_experts, -1)) for w in stacked)
            scales = tuple(w.scales.unflatten(0, (self.num_experts, -1)) for w in stacked)
        else:
            matrices, scales = tuple(w.weight.unflatten(0, (self.num_experts, -1)) for w in stacked), None
        return fused_moe(x, *matrices, weights.float().contiguous(), experts,
                         lambda gate_up: gated_activation(gate_up, self.act, self.fused_silu),
                         check_expert_ids=False, first_expert=self.held.start if self.sharded else None,
                         scales=scales)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, experts: [T, top_k] -> the weighted sum of each token's
        experts' outputs [T, hidden] (this rank's partial sum under tensor or expert
        parallelism: under expert parallelism the pairs routed to its experts only); the
        Triton ``fused_moe`` kernel on CUDA when triton is installed (float or int8 experts,
        under expert parallelism too; w8a8's int8 activations take the generic path). Every
        pair of the step, this rank's experts' or not, is added to ``routed`` (pairs per
        expert since the model was built, ``routed_pairs``)."""
        routed = torch.bincount(experts.flatten(), minlength=self.total_experts)
        self.routed += routed
        return self._pairs(x, weights, experts, routed)

    def _pairs(self, x: torch.Tensor, weights: torch.Tensor | None, experts: torch.Tensor,
               routed: torch.Tensor) -> torch.Tensor:
        """``forward``'s sum, ``routed`` holding the step's pairs per expert; ``weights`` None:
        each pair's output unweighted (the ranks that receive dispatched pairs)."""
        if x.device.type == "cuda" and self.fused_kernel_runs() and triton_unavailable_reason() is None:
            if weights is None:  # the kernel always weights its pairs
                weights = torch.ones(experts.shape, dtype=torch.float32, device=x.device)
            return self.fused(x, weights, experts)
        flat = experts.flatten()
        top_k = experts.shape[1]
        if self.sharded:  # only the pairs routed to this rank's experts
            pairs = ((flat >= self.held.start) & (flat < self.held.stop)).nonzero().squeeze(1)
            flat = flat[pairs] - self.held.start
        order = torch.argsort(flat, stable=True)
        if self.sharded:
            order = pairs[order]
        tokens = order // top_k  # the token of each (token, choice) pair, grouped by expert
        counts = routed[self.held.start:self.held.stop].tolist()
        packed = x.index_select(0, tokens)
        out = self._grouped(packed, counts)
        if out is None:
            out = torch.empty_like(packed)
            start = 0
            for expert, count in enumerate(counts):
                if count:
                    rows = slice(start, start + count)
                    gate_up = self.gate_up_proj.matmul(packed[rows], expert)
                    out[rows] = self.down_proj.matmul(gated_activation(gate_up, self.act, self.fused_silu), expert)
                    start += count
        if weights is not None:
            out.mul_(weights.flatten()[order].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """``rows`` (the pairs' hidden states sorted by expert, ``counts`` per expert)
        through their experts, every expert's gate/up and down in one native call each (the
        same results, to the bit, as one call per expert); None where the experts have no
        grouped kernel (not SiLU, not float32 rows, not on the CPU's native ops)."""
        if not (self.fused_silu and rows.shape[0] and use_native(rows)):
            return None
        experts = [e for e, count in enumerate(counts) if count]
        sizes = [counts[e] for e in experts]
        groups = (experts, list(itertools.accumulate(sizes[:-1], initial=0)), sizes)
        gate_up = self.gate_up_proj.grouped(rows, groups)
        if gate_up is None:
            return None
        return self.down_proj.grouped(gated_activation(gate_up, self.act, True), groups)

    def dispatched(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   parallel: ModelParallel) -> torch.Tensor:
        """``forward`` for this rank's share of the tokens under ``all_to_all`` dispatch:
        the ranks exchange their pairs per expert (one all-gather), each (token, expert)
        pair's hidden state goes to the rank holding the expert (all-to-all), runs there and
        comes back (all-to-all), and this rank adds its tokens' weighted results. Every
        rank's pairs are added to ``routed``."""
        ranks = parallel.tp_size
        flat = experts.flatten()
        mine = torch.bincount(flat, minlength=self.total_experts)
        counts = parallel.all_gather(mine).view(ranks, -1)  # [ranks, E]: every rank's pairs per expert
        total = counts.sum(0)
        self.routed += total
        per_rank = counts.unflatten(1, (ranks, -1)).sum(2)  # [source, owner]: pairs sent
        send, receive = per_rank[parallel.tp_rank].tolist(), per_rank[:, parallel.tp_rank].tolist()
        order = torch.argsort(flat, stable=True)  # by expert, so by owning rank
        tokens = order // experts.shape[1]
        arrived = parallel.all_to_all(x[tokens], send, receive)
        arrived_experts = parallel.all_to_all(flat[order], send, receive).unsqueeze(1)
        results = parallel.all_to_all(self._pairs(arrived, None, arrived_experts, total), receive, send)
        results.mul_(weights.flatten()[order].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, results)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (``shared_intermediate_size``) the shared experts, gated
    when the layout says so; one all-reduce over the tensor-parallel ranks."""

    def __init__(self, hf_config: Any, layout: ExpertLayout, layer: int, parallel: ModelParallel):
        super().__init__()
        hidden, activation = hf_config.hidden_size, activation_of(hf_config)
        from transformers.activations import ACT2FN

        self.parallel = parallel
        self.gate = Router(hidden, layout.num_experts, layout.routing)
        self.experts = ExpertWeights(layout, hidden, parallel, layer, ACT2FN[activation], activation == "silu")
        self.shared = bool(layout.shared_intermediate_size)
        self.shared_gated = self.shared and layout.shared_gated
        if self.shared:
            self.shared_expert = GatedMLP(hf_config, parallel, layout.shared_intermediate_size, reduce=False)
        if self.shared_gated:
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def pieces(self, leaf: str, tensor: torch.Tensor) -> list[WeightPiece] | None:
        """A checkpoint's stacked ``experts.gate_up_proj`` / ``experts.down_proj`` (the
        experts' pieces, under ``experts.``); None for other leaves."""
        child, _, part = leaf.partition(".")
        if child != "experts" or part not in ("gate_up_proj", "down_proj"):
            return None
        return [WeightPiece(f"experts.{p.param}", p.start, p.tensor) for p in self.experts.pieces(part, tensor)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. Under ``all_to_all`` dispatch this rank routes its
        ``token_rows`` alone and their routed sum fills those rows; the all-reduce then
        gathers every rank's rows beside the shared experts' partial sums."""
        if self.parallel.dispatches_tokens:
            rows = self.parallel.token_rows(x.shape[0])
            weights, experts = self.gate(x[rows])
            out = torch.zeros_like(x)
            out[rows] = self.experts.dispatched(x[rows], weights, experts, self.parallel)
        else:
            weights, experts = self.gate(x)
            out = self.experts(x, weights, experts)
        if self.shared_gated:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared:
            out += self.shared_expert(x)
        return self.parallel.all_reduce(out) if self.parallel.tp_size > 1 else out


class SparseDecoderLayer(DecoderLayer):
    """Llama's layer with a ``SparseMoeBlock`` in the layout's sparse layers."""

    def build_mlp(self, hf_config: Any, layer_index: int, parallel: ModelParallel) -> nn.Module:
        """The mixture of experts in sparse layers, the dense gated MLP in the others."""
        layout = ExpertLayout.of(hf_config)
        layer = parallel.layer_range(hf_config.num_hidden_layers).start + layer_index
        if layer in layout.sparse_layers:
            return SparseMoeBlock(hf_config, layout, layer, parallel)
        return super().build_mlp(hf_config, layer_index, parallel)


def routed_pairs(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Per sparse layer of ``model`` (by its index in the whole model), the pairs routed to
    each expert so far; empty for a model without experts."""
    return {module.layer: tuple(module.routed.tolist()) for module in model.modules()
            if isinstance(module, ExpertWeights)}


def checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module,
                     aliases: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with per-expert names ``...experts.N.P.weight`` renamed ``...experts.P.N``
    (a quantized checkpoint's ``.qweight`` / ``.scales`` ``...experts.P:qweight.N``;
    ``aliases`` first maps a checkpoint's projection names to ``PROJECTIONS``), so the
    loader hands them to ``ExpertWeights.pieces``; once they are all read, a ``ConfigError``
    names every expert projection of ``model`` the checkpoint did not give."""
    per_expert = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.(weight|qweight|scales)")
    for name, tensor in weights:
        match = per_expert.fullmatch(name)
        if match:
            kind = "" if match[4] == "weight" else f":{match[4]}"
            name = f"{match[1]}.{aliases.get(match[3], match[3])}{kind}.{match[2]}"
        yield name, tensor
    missing = [name for module in model.modules() if isinstance(module, ExpertWeights) for name in module.missing()]
    if missing:
        raise ConfigError([f"checkpoint is missing expert weights: {', '.join(missing[:8])}"
                           + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")])


class SparseForCausalLM(LlamaFamilyForCausalLM):
    """A Llama-family causal LM whose layers are ``SparseDecoderLayer``s; subclasses name
    their checkpoint's expert projections (``EXPERT_ALIASES``)."""

    LAYER = SparseDecoderLayer
    EXPERT_ALIASES: dict[str, str] = {}
    """Checkpoint projection names -> ``PROJECTIONS`` (Mixtral's w1, w3, w2)."""

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """Llama's sizes with the MLP priced as ``ExpertLayout.priced`` says; refuses a
        ``num_experts_per_tok`` outside [1, experts]."""
        return ExpertLayout.of(hf_config).priced(super().shape_of(hf_config))

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        problems = ExpertLayout.of(hf_config).split_problems(parallel.tp_size, hf_config.intermediate_size,
                                                             hf_config.num_hidden_layers, parallel.expert_parallel)
        if problems:
            raise ConfigError(problems)
        super().__init__(hf_config, attention, dtype, max_positions, parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The shared loader over ``checkpoint_names``."""
        super().load_weights(checkpoint_names(weights, self, self.EXPERT_ALIASES))

    def warm_up(self, max_tokens: int) -> int:
        """The shared warm-up, and every expert's blocked (or int8 kernel) copy packed
        where it multiplies."""
        warmed = super().warm_up(max_tokens)
        for module in self.modules():
            if isinstance(module, StackedWeight) and module.blocked:
                module.packed()
            elif isinstance(module, QuantizedStackedWeight):
                module.pack()
        return warmed
