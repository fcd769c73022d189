"""The cost model contract: how long one forward pass of a model takes on some hardware.

``executor=simulated`` asks its cost model the time of every step the real scheduler
forms and advances a virtual clock by it; no model runs. Cost models are registered
components (``cost_model=roofline``, ``cost_model=profiled``, ...) built as
``cls(config, CostModelContext)``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from servelab.core.config import HardwareConfig, ParallelConfig
from servelab.core.errors import ConfigError
from servelab.core.model import ModelShape
from servelab.core.quantization import WeightQuantization


@dataclass(frozen=True, slots=True)
class AdapterWork:
    """One LoRA adapter's share of a forward pass: its ``tokens`` in the pass, its
    ``rank`` (the largest of its modules') and the decoder projections it adapts in every
    layer, by their Hugging Face names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``gate_proj``, ``up_proj``, ``down_proj``)."""

    tokens: int
    rank: int
    projections: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The work of one forward pass: per request, ``query_lens[i]`` new tokens ending a
    context of ``context_lens[i]`` tokens (cached + new; a decode has one new token), and
    ``num_logits_rows`` rows that go through the LM head and sampling; ``start_s``, the
    clock time at which the pass starts (for cost models whose prices drift in time);
    ``adapters``: the work of each distinct LoRA adapter in the pass (none: the base
    model alone)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_logits_rows: int
    start_s: float = 0.0
    adapters: tuple[AdapterWork, ...] = ()

    @property
    def num_tokens(self) -> int:
        """New tokens in the pass (rows of every linear layer)."""
        return sum(self.query_lens)

    @property
    def num_requests(self) -> int:
        """Requests in the pass."""
        return len(self.query_lens)


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one forward pass costs: ``stage_times[s]`` seconds of pipeline stage ``s``
    (one entry without pipeline parallelism), including its tensor-parallel all-reduces;
    ``transfer_time`` seconds to send activations from one stage to the next; and a
    ``breakdown`` of the total by part (``(name, seconds)``, for reports)."""

    stage_times: tuple[float, ...]
    transfer_time: float = 0.0
    breakdown: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        """Seconds from the first stage's start to the last stage's end, one pass alone."""
        return sum(self.stage_times) + self.transfer_time * (len(self.stage_times) - 1)


@dataclass(frozen=True, slots=True)
class CostModelContext:
    """What a cost model is built for: the ``model``'s shape, one device of the
    ``hardware`` it runs on, the ``parallel`` split, and bytes per weight (``weight_bytes``), per KV cache element
    (``kv_bytes``) and per activation element (``activation_bytes``); ``quantization``: how
    the decoder's linear weights are stored when ``model.quantization`` asks for integers
    (their bytes then replace ``weight_bytes`` for those layers)."""

    model: ModelShape
    hardware: HardwareConfig
    parallel: ParallelConfig
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    activation_bytes: float = 2.0
    quantization: WeightQuantization | None = None


class CostModel(abc.ABC):
    """Prices forward passes of ``context.model`` on ``context.hardware``.

    Built as ``cls(config, CostModelContext)``; a constructor raises ``ConfigError``
    listing every problem (a model its tables do not cover, a split that does not divide
    the heads).
    """

    def __init__(self, config: Any, context: CostModelContext):
        self.config = config
        self.context = context

    @abc.abstractmethod
    def forward_cost(self, batch: BatchShape) -> StepCost:
        """The time of one forward pass over ``batch``, logits and sampling included (its
        ``adapters``' work too)."""

    def adapter_load_time(self, rank: int, projections: tuple[str, ...]) -> float:
        """Seconds to copy a LoRA adapter of ``rank`` on ``projections`` (in every layer)
        from host memory into a device slot; ``ConfigError`` from cost models that do not
        price adapters (the default)."""
        raise ConfigError([f"cost model {type(self).__name__} does not price LoRA adapters"])

    def adapter_merge_time(self, rank: int, projections: tuple[str, ...]) -> float:
        """Seconds to add such an adapter into the base weights (removing it costs the
        same); ``ConfigError`` from cost models that do not price adapters (the default)."""
        raise ConfigError([f"cost model {type(self).__name__} does not price LoRA adapters"])
