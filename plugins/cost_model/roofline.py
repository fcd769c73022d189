"""``cost_model=roofline``: every operator of a step priced from its FLOPs and bytes.

An operator takes ``max(flops / (peak_flops x compute_efficiency), bytes /
(memory_bandwidth x memory_efficiency)) + kernel_overhead_s`` on one device
(``plugins/cost_model/operators.py`` counts the work). A layer adds attention priced from
each request's real context within the layer's own window (``ModelShape.window_of``), two
all-reduces of its activations under tensor parallelism (``collectives.py``) and
``layer_overhead_s``; LoRA adapters in the step add their low-rank matmuls, each
adapter's weights read once (``lora_operators.py``); a mixture of experts' sparse layers
price their MLP expert by expert, with expert parallelism's all-to-alls (``experts.py``);
a step adds the embedding on the first pipeline stage, the final norm, the LM head and
sampling on the last, and ``step_overhead_s`` of host work. Pipeline stages hold contiguous layer ranges and send
their activations to the next stage (``StepCost.transfer_time``). The efficiencies are the
hardware's (``conf/hardware/*.yaml``, calibrated against measured operator times); the
overheads are this config's. Decoder linear weights quantized by ``model.quantization``
are read at their stored width (the integers and their scales) at the same FLOPs:
dequantizing inside the matmul is taken as free. docs/simulation.md has the assumptions
and their error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from servelab.core.component import ComponentSpec
from servelab.core.cost_model import BatchShape, CostModel, CostModelContext, StepCost
from servelab.core.errors import ConfigError
from servelab.core.model import ModelShape
from servelab.plugins.cost_model.collectives import (all_gather_time, all_reduce_time, pipeline_crosses_nodes,
                                                     send_time, stage_layer_counts)
from servelab.plugins.cost_model.experts import dispatch_bytes, sparse_mlp_operators
from servelab.plugins.cost_model.lora_operators import adapter_bytes, lora_operators, merge_operators
from servelab.plugins.cost_model.operators import (Operator, Widths, attention_operators, first_stage_operators,
                                                   last_stage_operators, layer_operators)

MLP_OPERATORS = ("mlp_up_proj", "mlp_act", "mlp_down_proj")
"""The dense MLP's operators, which a sparse layer replaces with its experts'."""

LayerKind = tuple[int | None, bool]
"""What prices a decoder layer: its attention window (None: the whole context) and
whether its MLP is a mixture of experts."""

CACHE_LIMIT = 1 << 16
"""Priced token counts (and token, logits-row pairs) kept before the caches start over."""


@dataclass
class RooflineCostModelConfig:
    """``cost_model=roofline``: ``kernel_overhead_s``, the fixed time every operator pays
    beyond its roofline time (launch and tail; 7 us fits the measured A100 and H100
    operator tables, docs/simulation.md); ``layer_overhead_s``, more per decoder layer;
    ``step_overhead_s``, host time per step (scheduling, input preparation, output
    processing) before the first stage starts."""

    kernel_overhead_s: float = 7.0e-6
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.0


class RooflineCostModel(CostModel):
    """Prices a step operator by operator on ``context.hardware`` (see the module
    docstring). Subclasses replace ``dense_times`` (a layer's operators but attention),
    ``all_reduce`` or ``step_overhead`` with measurements."""

    def __init__(self, config: RooflineCostModelConfig, context: CostModelContext):
        super().__init__(config, context)
        raise_problems(roofline_problems(config, context))
        parallel = context.parallel
        self.tp, self.pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.ep = parallel.expert_parallel_size
        self.widths = Widths.of(context.model, self.tp, context.weight_bytes, context.kv_bytes,
                                context.activation_bytes, context.quantization)
        self.stage_layers = stage_layer_counts(context.model.num_layers, self.pp)
        starts = [sum(self.stage_layers[:stage]) for stage in range(self.pp)]
        self.stage_kinds = [layer_kinds(context.model, range(start, start + count))
                            for start, count in zip(starts, self.stage_layers)]
        self.kinds = layer_kinds(context.model, range(context.model.num_layers))
        self.crosses_nodes = pipeline_crosses_nodes(self.tp, self.pp, context.hardware)
        self._dense: dict[tuple[int, bool], tuple[tuple[str, float], ...]] = {}
        self._ends: dict[tuple[int, int], tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]] = {}

    # -- operators ----------------------------------------------------------------------------
    def operator_time(self, operator: Operator) -> float:
        """Seconds of one operator on one device: its roofline time plus the kernel overhead."""
        hw = self.context.hardware
        compute = operator.flops / (hw.peak_flops * hw.compute_efficiency)
        memory = operator.bytes / (hw.memory_bandwidth * hw.memory_efficiency)
        return max(compute, memory) + self.config.kernel_overhead_s

    def dense_times(self, num_tokens: int) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of one layer's operators but attention and all-reduces."""
        return tuple((op.name, self.operator_time(op)) for op in layer_operators(num_tokens, self.widths))

    def sparse_times(self, num_tokens: int) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of a sparse layer's operators but attention and collectives:
        ``dense_times`` with the MLP's replaced by the mixture of experts' on its busiest rank."""
        experts = sparse_mlp_operators(num_tokens, self.widths, self.context.model.experts, self.tp, self.ep)
        return (*((name, t) for name, t in self.dense_times(num_tokens) if name not in MLP_OPERATORS),
                *((op.name, self.operator_time(op)) for op in experts))

    def attention_times(self, batch: BatchShape, window: int | None) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of one layer's attention over the batch's contexts within
        ``window`` (None: the whole context)."""
        return tuple((op.name, self.operator_time(op)) for op in attention_operators(batch, self.widths, window))

    def lora_times(self, batch: BatchShape) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of one layer's LoRA shrink and expand launches for the batch's
        adapters (``lora_operators.py``)."""
        return tuple((op.name, self.operator_time(op)) for op in lora_operators(batch.adapters, self.widths))

    def adapter_load_time(self, rank: int, projections: tuple[str, ...]) -> float:
        """One device's share of the adapter (its layers of every pipeline stage) over
        ``hardware.host_bandwidth``, the link swaps and the host KV tier use."""
        layers = max(self.stage_layers)
        return adapter_bytes(rank, projections, self.widths, layers) / self.context.hardware.host_bandwidth

    def adapter_merge_time(self, rank: int, projections: tuple[str, ...]) -> float:
        """``W += B A`` in every layer of the busiest stage, each projection one operator."""
        per_layer = sum(self.operator_time(op) for op in merge_operators(rank, projections, self.widths))
        return max(self.stage_layers) * per_layer

    def all_reduce(self, num_bytes: float) -> float:
        """Seconds of one all-reduce of ``num_bytes`` among the tensor-parallel ranks."""
        return all_reduce_time(num_bytes, self.tp, self.context.hardware)

    def first_stage_times(self, num_tokens: int) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of the first stage's own work: the embedding."""
        return tuple((op.name, self.operator_time(op)) for op in first_stage_operators(num_tokens, self.widths))

    def last_stage_times(self, num_tokens: int, num_logits_rows: int) -> tuple[tuple[str, float], ...]:
        """(name, seconds) of the last stage's own work: final norm, LM head, gathering the
        vocabulary slices of the logits across ranks, sampling."""
        times = [(op.name, self.operator_time(op)) for op in last_stage_operators(num_tokens, num_logits_rows,
                                                                                  self.widths)]
        if num_logits_rows and self.tp > 1:
            logits = num_logits_rows * self.context.model.vocab_size * 4.0
            times.insert(2, ("logits_gather", all_gather_time(logits, self.tp, self.context.hardware)))
        return tuple(times)

    def step_overhead(self, batch: BatchShape) -> float:
        """Host seconds per step before the first stage runs."""
        return self.config.step_overhead_s

    # -- one step ------------------------------------------------------------------------------
    def layer_times(self, batch: BatchShape, layer: int = 0) -> list[tuple[str, float]]:
        """(name, seconds) of decoder layer ``layer``: its operators, attention within
        its window, the LoRA adapters' low-rank matmuls, the two all-reduces under
        tensor parallelism (a sparse layer under expert parallelism: one, and the dispatch
        and combine all-to-alls) and the layer overhead."""
        return self._layer_times(batch, layer_kind(self.context.model, layer))

    def _layer_times(self, batch: BatchShape, kind: LayerKind) -> list[tuple[str, float]]:
        window, sparse = kind
        tokens = batch.num_tokens
        dense = self._dense.get((tokens, sparse))
        if dense is None:
            if len(self._dense) > CACHE_LIMIT:
                self._dense.clear()
            dense = self._dense[tokens, sparse] = self.sparse_times(tokens) if sparse else self.dense_times(tokens)
        times = list(dense)
        times += self.attention_times(batch, window)
        if batch.adapters:
            times += self.lora_times(batch)
        activations = tokens * self.widths.hidden * self.widths.ab
        if sparse and self.ep > 1:
            times.append(("all_reduce", self.all_reduce(activations)))
            moved = dispatch_bytes(tokens, self.widths, self.context.model.experts, self.ep)
            times.append(("all_to_all", 2 * all_gather_time(moved, self.ep, self.context.hardware)))
        elif self.tp > 1:
            times.append(("all_reduce", 2 * self.all_reduce(activations)))
        if self.config.layer_overhead_s:
            times.append(("layer_overhead", self.config.layer_overhead_s))
        return times

    def forward_cost(self, batch: BatchShape) -> StepCost:
        """Per-stage seconds of one forward pass, the stage-to-stage transfer, a breakdown."""
        tokens = batch.num_tokens
        layers = {kind: self._layer_times(batch, kind) for kind, _ in self.kinds}
        per_layer = {kind: sum(seconds for _, seconds in times) for kind, times in layers.items()}
        totals: dict[str, float] = {}
        for kind, count in self.kinds:
            for name, seconds in layers[kind]:
                totals[name] = totals.get(name, 0.0) + count * seconds
        key = (tokens, batch.num_logits_rows)
        ends = self._ends.get(key)
        if ends is None:
            if len(self._ends) > CACHE_LIMIT:
                self._ends.clear()
            ends = self._ends[key] = (self.first_stage_times(tokens),
                                      self.last_stage_times(tokens, batch.num_logits_rows))
        first, last = ends
        overhead = self.step_overhead(batch)
        stage_times = [sum(count * per_layer[kind] for kind, count in kinds) for kinds in self.stage_kinds]
        stage_times[0] += overhead + sum(seconds for _, seconds in first)
        stage_times[-1] += sum(seconds for _, seconds in last)
        transfer = 0.0
        if self.pp > 1:
            transfer = send_time(tokens * self.widths.hidden * self.widths.ab, self.crosses_nodes,
                                 self.context.hardware)
        breakdown = [("step_overhead", overhead), *first, *totals.items(), *last]
        if self.pp > 1:
            breakdown.append(("transfer", transfer * (self.pp - 1)))
        return StepCost(tuple(stage_times), transfer, tuple(breakdown))


def layer_kind(shape: ModelShape, layer: int) -> LayerKind:
    """Decoder layer ``layer``'s window and whether its MLP is sparse."""
    return shape.window_of(layer), shape.experts is not None and shape.experts.is_sparse(layer)


def layer_kinds(shape: ModelShape, layers: range) -> tuple[tuple[LayerKind, int], ...]:
    """(kind, layers) of each distinct ``layer_kind`` among ``layers``, in order of first appearance."""
    return tuple(Counter(layer_kind(shape, layer) for layer in layers).items())


def roofline_problems(config: RooflineCostModelConfig, context: CostModelContext) -> list[str]:
    """What keeps the roofline from pricing this model on this hardware."""
    problems = []
    for field in ("kernel_overhead_s", "layer_overhead_s", "step_overhead_s"):
        if getattr(config, field) < 0:
            problems.append(f"cost_model.{field} must be >= 0, got {getattr(config, field)}")
    hw = context.hardware
    for field in ("compute_efficiency", "memory_efficiency", "interconnect_efficiency"):
        value = getattr(hw, field)
        if not 0.0 < value <= 1.0:
            problems.append(f"hardware.{field} must be in (0, 1], got {value} (hardware={hw.name})")
    for field in ("peak_flops", "memory_bandwidth", "interconnect_bandwidth", "network_bandwidth"):
        if getattr(hw, field) <= 0:
            problems.append(f"hardware.{field} must be > 0, got {getattr(hw, field)} (hardware={hw.name})")
    shape = context.model
    if shape.hidden_size <= 0 or shape.intermediate_size <= 0:
        problems.append(f"a cost model needs the model's hidden_size and intermediate_size (got "
                        f"{shape.hidden_size} and {shape.intermediate_size})")
    return problems


def raise_problems(problems: list[str]) -> None:
    """Raise one ``ConfigError`` with every problem, if any."""
    if problems:
        raise ConfigError(problems)


SPEC = ComponentSpec("cost_model", "roofline", RooflineCostModel, RooflineCostModelConfig,
                     "FLOPs and bytes of every operator on the hardware's roofline (default)")
