"""LoRA adapters under ``executor=simulated``: adapter slots paged as the model executor
pages them (``LoRASlotTable``), every load and merge priced by the cost model, and the
forward passes a step runs as.

``executor.lora_serving`` picks how a step's adapters run:

- ``batched`` (S-LoRA, Punica, ``executor=model``): every adapter of the step unmerged in
  one pass through the slots, its low-rank matmuls priced by the cost model
  (``BatchShape.adapters``); a step needing more adapters than there are slots splits
  into passes of ``num_slots`` adapters, as the model executor's.
- ``merged`` (the baseline S-LoRA compares against, and ``benchmarks/lora_throughput.py``'s
  "merge one at a time"): one adapter is merged into the base weights at a time, so a
  step runs one pass per adapter (the base model's requests a pass of their own, on
  unmerged weights), the adapter already merged first; each switch costs unmerging the
  old adapter and merging the new one (``CostModel.adapter_merge_time``).

Either way an adapter that is not in a slot is copied from host memory first
(``CostModel.adapter_load_time``: the hardware's host link) and the paging counters are
the model executor's (``LoRAStats``: hits, loads, load seconds, split steps).

Adapters without weights (``register_shape_only``) are what a simulated benchmark serves
(``workload.num_adapters``, docs/bench.md): their modules are meta tensors of the model's
projection shapes, so the engine registers and checks them like adapters read from PEFT.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from servelab.core.cost_model import AdapterWork, CostModel
from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.lora_adapter import LoRAAdapter, LoRAModule
from servelab.core.model import ModelShape
from servelab.core.scheduler import ScheduledRequest
from servelab.plugins.cost_model.lora_operators import (ATTENTION_PROJECTIONS, PROJECTIONS, adapter_bytes,
                                                        projection_features)
from servelab.plugins.cost_model.operators import Widths
from servelab.plugins.executor.lora_slot_table import LoRASlotTable
from servelab.plugins.executor.lora_slots import slot_count

LORA_SERVING = ("batched", "merged")
"""The values of ``executor.lora_serving``."""


def model_projections(shape: ModelShape) -> tuple[str, ...]:
    """The projections of ``shape``'s decoder layers an adapter can adapt."""
    widths = Widths.of(shape, 1, 2.0, 2.0, 2.0)
    present = []
    for name in PROJECTIONS:
        try:
            projection_features(name, widths)
        except ValueError:
            continue
        present.append(name)
    return tuple(present)


def shape_only_modules(shape: ModelShape, rank: int, projections: Sequence[str]) -> tuple[LoRAModule, ...]:
    """The modules of an adapter of ``rank`` on ``projections`` of every decoder layer of
    ``shape``, their ``A`` and ``B`` meta tensors (no storage); ``ConfigError`` naming the
    field for a rank below 1 or a projection the model lacks."""
    widths = Widths.of(shape, 1, 2.0, 2.0, 2.0)
    problems = [] if rank >= 1 else [f"workload.adapter_ranks: {rank} is not a rank (1 or more)"]
    for name in projections:
        try:
            projection_features(name, widths)
        except ValueError as exc:
            problems.append(f"workload.adapter_projections: {exc}")
    if problems:
        raise ConfigError(problems)
    modules = []
    for layer in range(shape.num_layers):
        for name in projections:
            inputs, outputs = projection_features(name, widths)
            block = "self_attn" if name in ATTENTION_PROJECTIONS else "mlp"
            modules.append(LoRAModule(f"model.layers.{layer}.{block}.{name}", torch.empty(rank, inputs, device="meta"),
                                      torch.empty(outputs, rank, device="meta")))
    return tuple(modules)


class SimulatedLoRA(LoRASlotTable):
    """The simulated executor's adapter slots (module docstring): as many as ``lora_cfg``
    gives (``lora.max_adapters``, or ``lora.memory_bytes`` over ``slot_bytes``, a slot
    sized as the model executor's: ``lora.max_rank`` on every projection), loads and
    merges priced by ``cost_model``."""

    def __init__(self, lora_cfg: Any, serving: str, cost_model: CostModel, shape: ModelShape, element_bytes: float,
                 tp: int, pp: int):
        if serving not in LORA_SERVING:
            raise ConfigError([f"executor.lora_serving must be one of {', '.join(LORA_SERVING)}, got {serving!r}"])
        self.projections = model_projections(shape)
        widths = Widths.of(shape, tp, element_bytes, element_bytes, element_bytes)
        layers = -(-shape.num_layers // pp)
        self.slot_bytes = int(adapter_bytes(lora_cfg.max_rank, self.projections, widths, layers))
        super().__init__(slot_count(lora_cfg, self.slot_bytes))
        self.merged = serving == "merged"
        self.cost_model = cost_model
        cost_model.adapter_load_time(1, self.projections)  # a ConfigError now from one that prices no adapters
        self.works: dict[int, tuple[int, tuple[str, ...]]] = {}  # load id -> (rank, projections)
        self.merged_adapter: int | None = None  # load id of the adapter in the base weights

    def add(self, adapter: LoRAAdapter) -> None:
        """Keep ``adapter``'s rank and projections; ``InvalidRequestError`` on
        ``target_modules`` for a module that is not a projection of the model."""
        projections = {module.name.rsplit(".", 1)[-1] for module in adapter.modules}
        unknown = sorted(projections.difference(self.projections))
        if unknown:
            raise InvalidRequestError("target_modules", f"adapter {adapter.name!r} adapts {', '.join(unknown)}, not "
                                                        f"projections of this model ({', '.join(self.projections)})")
        self.works[adapter.load_id] = (adapter.rank, tuple(p for p in PROJECTIONS if p in projections))

    def remove(self, adapter: LoRAAdapter) -> None:
        """Free ``adapter``'s slot; a request still running with it pages it in again."""
        self.resident.pop(adapter.load_id, None)

    def load(self, load_id: int, adapter: LoRAAdapter, slot: int) -> float:
        """The cost model's time to copy the adapter from host memory into a slot."""
        return self.cost_model.adapter_load_time(*self.works[load_id])

    def passes(self, grants: Sequence[ScheduledRequest],
               query_lens: Sequence[int]) -> list[tuple[list[int], float, tuple[AdapterWork, ...]]]:
        """The forward passes of a step whose grants compute ``query_lens`` tokens each: per
        pass its grants (by index), the seconds of loads and merges before it and the
        adapters' work it applies unmerged."""
        if self.merged:
            return self._merged_passes(grants)
        chunks = self.chunks(grants)
        if len(chunks) > 1:
            self.split_steps += 1
        out = []
        for chunk in chunks:
            tokens: dict[int, int] = {}
            adapters: dict[int, LoRAAdapter] = {}
            for i in chunk:
                adapter = grants[i].request.lora
                if adapter is not None:
                    adapters[adapter.load_id] = adapter
                    tokens[adapter.load_id] = tokens.get(adapter.load_id, 0) + query_lens[i]
            before = self.load_seconds
            self.page_in(adapters)
            work = tuple(AdapterWork(count, *self.works[load_id]) for load_id, count in tokens.items())
            out.append((chunk, self.load_seconds - before, work))
        return out

    def _merged_passes(self, grants: Sequence[ScheduledRequest]) -> list[tuple[list[int], float, tuple]]:
        """One pass per adapter, the merged one first (module docstring)."""
        groups: dict[int | None, list[int]] = {}
        for index, grant in enumerate(grants):
            adapter = grant.request.lora
            groups.setdefault(None if adapter is None else adapter.load_id, []).append(index)
        order = sorted(groups, key=lambda key: key != self.merged_adapter)
        out = []
        for key in order:
            seconds = 0.0
            if key != self.merged_adapter:
                if self.merged_adapter is not None:
                    seconds += self.cost_model.adapter_merge_time(*self.works[self.merged_adapter])
                if key is not None:
                    before = self.load_seconds
                    self.page_in({key: grants[groups[key][0]].request.lora})
                    seconds += self.load_seconds - before + self.cost_model.adapter_merge_time(*self.works[key])
                self.merged_adapter = key
            elif key is not None:
                self.page_in({key: grants[groups[key][0]].request.lora})
            out.append((groups[key], seconds, ()))
        return out


def register_shape_only(engine: Any, names: Sequence[str], ranks: Sequence[int], projections: Sequence[str]) -> None:
    """Register adapters without weights with a simulated ``engine``: ``names[i]`` of rank
    ``ranks[i % len(ranks)]`` on ``projections`` of every layer (``shape_only_modules``,
    shared by the adapters of one rank). ``ConfigError`` naming the field when the engine
    serves no adapters or runs a model, or a rank is above ``lora.max_rank``."""
    registry = engine.lora
    if registry is None or not isinstance(getattr(engine.executor, "lora", None), SimulatedLoRA):
        raise ConfigError(["workload.num_adapters: adapters without weights are served by executor=simulated with "
                           "lora.enabled=true (a real run names loaded adapters in workload.adapters)"])
    if not ranks:
        raise ConfigError(["workload.adapter_ranks must list at least one rank"])
    too_large = sorted({rank for rank in ranks if rank > registry.max_rank})
    if too_large:
        raise ConfigError([f"workload.adapter_ranks: {too_large} above lora.max_rank={registry.max_rank}"])
    modules = {rank: shape_only_modules(engine.executor.context.shape, rank, projections) for rank in set(ranks)}
    for i, name in enumerate(names):
        rank = ranks[i % len(ranks)]
        registry.register(name, lambda load_id, rank=rank, name=name: LoRAAdapter(
            name, f"shape-only:r{rank}", load_id, modules[rank]))
