"""``cost_model=profiled``: steps priced from measured tables (``table.py``'s format).

Two kinds of table drive it:

- ``operators`` (GPUs: servelab's conversion of Vidur's A100/H100 Llama-2-7B/70B
  tables): each layer operator the table has is interpolated at the step's token count
  and tensor-parallel degree; what it lacks is priced by the roofline
  (``roofline.py``): attention over the KV cache (Vidur's operator tables do not include
  it), the final norm, the LM head and sampling. All-reduces come from a ``collectives``
  table of the hardware (the DGX measurements) when it has the split, else the roofline's
  ring formula; pipeline sends are the roofline's. With quantized weights
  (``model.quantization``) the four linear-layer matmuls are the roofline's at their
  stored width, since the tables time 16-bit weights.
- ``steps`` (a machine measured by ``servelab-bench mode=profile``): the whole step and
  the engine's host time around it (``step_table.py``). With ``jitter`` (the default)
  and a table that records its dispersion, each step's time is multiplied by a factor
  drawn (seeded by ``seed``) with the spread the profile measured across repeats, and with
  ``jitter_persistence`` the persistence in time it measured too (``step_jitter.py``). A
  step table covers the ``model.quantization`` it was measured with.

With ``table`` unset the shipped table for the configured hardware and model is used; a
model, split, dtype or hardware no table covers is refused with a ``ConfigError`` naming
what the tables cover.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.cost_model import BatchShape, CostModelContext, StepCost
from servelab.core.errors import ConfigError
from servelab.plugins.cost_model.operators import LAYER_OPERATORS, LINEAR_OPERATORS, window_groups
from servelab.plugins.cost_model.roofline import RooflineCostModel, RooflineCostModelConfig
from servelab.plugins.cost_model.step_jitter import StepJitter
from servelab.plugins.cost_model.step_table import StepTableModel
from servelab.plugins.cost_model.table import CostTable, load_table, shipped_tables

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}

log = logging.getLogger(__name__)


def this_cpu() -> str | None:
    """This machine's CPU model (``/proc/cpuinfo``), None where unknown."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        return None


@dataclass
class ProfiledCostModelConfig(RooflineCostModelConfig):
    """``cost_model=profiled``: ``table``, a table file (a path, or the name of a shipped
    one; null: the shipped table that covers the hardware and model); ``collectives``, an
    all-reduce table the same way (null: the shipped one of the hardware, if any). The
    roofline's fields price what an operator table lacks. ``jitter``: draw each step's
    time from a step table's measured dispersion (``meta.dispersion``) rather than using its
    median; ``jitter_persistence``: also give the draws the persistence in time the profile
    measured (off by default: on the two-core VM it widened the spread between simulated
    runs past the real runs' and did not lower the error, docs/results/simulation.md);
    ``seed`` seeds the draws."""

    table: Optional[str] = None
    collectives: Optional[str] = None
    jitter: bool = True
    jitter_persistence: bool = False
    seed: int = 0


def _resolve(name: str) -> Path:
    """A table file: a path, or the name of a shipped table."""
    path = Path(name)
    if path.exists():
        return path
    for shipped in shipped_tables():
        if shipped.name in (name, f"{name}.json"):
            return shipped
    names = ", ".join(p.name for p in shipped_tables())
    raise ConfigError([f"cost_model table {name!r} is neither a file nor a shipped table ({names})"])


def _coverage(table: CostTable, context: CostModelContext) -> list[str]:
    """Why ``table`` does not cover this model, dtype, split and hardware."""
    hw, shape, parallel = context.hardware.name, context.model, context.parallel
    problems = []
    if hw not in table.hardware:
        problems.append(f"it measures hardware={'/'.join(table.hardware)}, not hardware={hw}")
    mismatch = table.shape_mismatch(shape)
    if mismatch:
        problems.append(f"the model differs: {'; '.join(mismatch)}")
    table_bytes = DTYPE_BYTES.get(table.dtype or "")
    if table_bytes is not None and table_bytes != context.weight_bytes:
        problems.append(f"it times {table.dtype} ({table_bytes} bytes per weight), the model runs with "
                        f"{context.weight_bytes:g}-byte weights (model.dtype)")
    weights = context.quantization.mode if context.quantization else "none"
    measured = table.meta.get("engine", {}).get("quantization", "none")
    if table.kind == "steps" and measured != weights:
        problems.append(f"its steps were measured with model.quantization={measured}, the model runs with "
                        f"model.quantization={weights}; profile it so (servelab-bench mode=profile "
                        f"model.quantization={weights})")
    if table.kind == "steps" and parallel.num_devices > 1:
        problems.append(f"a step table is measured on one device; parallel.tensor_parallel_size="
                        f"{parallel.tensor_parallel_size} and pipeline_parallel_size={parallel.pipeline_parallel_size} "
                        f"are not covered")
    if table.kind == "operators":
        degrees = table.values("mlp_up_proj", "tensor_parallel_size")
        if parallel.tensor_parallel_size not in degrees:
            problems.append(f"it covers tensor parallelism {', '.join(map(str, degrees))}, not "
                            f"parallel.tensor_parallel_size={parallel.tensor_parallel_size}")
    return problems


def select_table(config: ProfiledCostModelConfig, context: CostModelContext) -> CostTable:
    """The configured table, or the shipped one covering the model; ``ConfigError`` otherwise."""
    shape = context.model
    what = (f"{shape.num_layers} layers, hidden_size {shape.hidden_size}, {shape.num_heads}/{shape.num_kv_heads} "
            f"heads, intermediate_size {shape.intermediate_size}, vocab_size {shape.vocab_size} on "
            f"hardware={context.hardware.name}")
    if config.table is not None:
        table = load_table(_resolve(config.table))
        problems = _coverage(table, context)
        if problems:
            raise ConfigError([f"cost_model.table={config.table} does not cover {what}: {p}" for p in problems])
        return table
    candidates = [load_table(p) for p in shipped_tables()]
    candidates = [t for t in candidates if t.kind in ("operators", "steps")]
    for table in candidates:
        if not _coverage(table, context):
            return table
    near = [f"{t.describe()} ({'; '.join(_coverage(t, context))})" for t in candidates
            if context.hardware.name in t.hardware]
    listing = "; ".join(near) if near else "none for this hardware; shipped: " + ", ".join(
        sorted({h for t in candidates for h in t.hardware}))
    raise ConfigError([f"cost_model=profiled has no table for {what} (tables: {listing}). Measure one with "
                       f"`servelab-bench mode=profile` on the machine and pass cost_model.table=FILE, or use "
                       f"cost_model=roofline"])


def select_collectives(config: ProfiledCostModelConfig, context: CostModelContext) -> CostTable | None:
    """The configured all-reduce table, or the shipped one of the hardware, or None."""
    if config.collectives is not None:
        table = load_table(_resolve(config.collectives))
        if table.kind != "collectives" or context.hardware.name not in table.hardware:
            raise ConfigError([f"cost_model.collectives={config.collectives} is not an all-reduce table of "
                               f"hardware={context.hardware.name} ({table.describe()})"])
        return table
    for path in shipped_tables():
        table = load_table(path)
        if table.kind == "collectives" and context.hardware.name in table.hardware:
            return table
    return None


class ProfiledCostModel(RooflineCostModel):
    """Interpolates measured tables; the roofline prices what they do not hold."""

    def __init__(self, config: ProfiledCostModelConfig, context: CostModelContext):
        super().__init__(config, context)
        self.table = select_table(config, context)
        self.steps: StepTableModel | None = None
        self.collective = None
        self.jitter: StepJitter | None = None
        if self.table.kind == "steps":
            problems = StepTableModel.problems(self.table)
            if problems:
                raise ConfigError(problems)
            self.steps = StepTableModel(self.table, window_groups(context.model))
            measured_on = self.table.meta.get("machine", {}).get("cpu")
            if measured_on and this_cpu() and measured_on != this_cpu():
                log.warning("cost table %s was measured on %s, this machine is %s: its times are that machine's",
                            self.table.path, measured_on, this_cpu())
            dispersion = self.table.meta.get("dispersion", {})
            quantiles = dispersion.get("step_time_over_median")
            if config.jitter and quantiles:
                try:
                    persistence = dispersion.get("persistence", ()) if config.jitter_persistence else ()
                    self.jitter = StepJitter(quantiles, config.seed, persistence)
                except ValueError as error:
                    raise ConfigError([f"cost table {self.table.path}: meta.dispersion: {error}"]) from None
            return
        tp = self.tp
        self.series = {op: self.table.find(op, tensor_parallel_size=tp) for op in ("emb", *LAYER_OPERATORS)}
        collectives = select_collectives(config, context)
        if collectives is not None and tp > 1:
            per_node = min(tp, context.hardware.devices_per_node)
            self.collective = collectives.find("all_reduce", num_devices=tp, devices_per_node=per_node)

    def dense_times(self, num_tokens: int) -> tuple[tuple[str, float], ...]:
        """Each operator from the table at ``num_tokens`` (the roofline's where it has none,
        and for the linear layers when quantized weights replace the measured floats)."""
        roofline = super().dense_times(num_tokens)
        quantized = LINEAR_OPERATORS if self.context.quantization is not None else ()
        return tuple((name, self.series[name].at(num_tokens) if self.series.get(name) and name not in quantized
                      else seconds) for name, seconds in roofline)

    def first_stage_times(self, num_tokens: int) -> tuple[tuple[str, float], ...]:
        """The embedding from the table."""
        emb = self.series.get("emb")
        if emb is None:
            return super().first_stage_times(num_tokens)
        return (("emb", emb.at(num_tokens)),)

    def all_reduce(self, num_bytes: float) -> float:
        """The measured all-reduce of the split, else the roofline's."""
        if self.collective is not None:
            return self.collective.at(num_bytes)
        return super().all_reduce(num_bytes)

    def forward_cost(self, batch: BatchShape) -> StepCost:
        """Operator tables: the roofline's composition with measured operators; step
        tables: the measured step plus the engine's host time (on the one stage) and the
        roofline's price of the LoRA adapters' matmuls (``lora``; the tables measure
        none), times a drawn factor with ``jitter`` (its share is the ``jitter`` part)."""
        if self.steps is None:
            return super().forward_cost(batch)
        parts = (*self.steps.forward_time(batch),
                 ("engine_overhead", self.steps.engine_overhead(batch) + self.config.step_overhead_s))
        if batch.adapters:
            parts = (*parts, ("lora", self.context.model.num_layers * sum(t for _, t in self.lora_times(batch))))
        total = sum(seconds for _, seconds in parts)
        if self.jitter is not None:
            extra = total * (self.jitter.factor(batch.start_s) - 1)
            parts, total = (*parts, ("jitter", extra)), total + extra
        return StepCost((total,), 0.0, parts)


SPEC = ComponentSpec("cost_model", "profiled", ProfiledCostModel, ProfiledCostModelConfig,
                     "interpolates measured tables: Vidur's A100/H100 operators, or steps from mode=profile")
