"""How a mixture of experts' router turns each token's logits into its experts and their
weights, for every family servelab serves, as transformers computes them:

- Mixtral, Qwen2-MoE, Qwen3-MoE: the top ``top_k`` of the float32 softmax, renormalised
  to sum to one when ``normalize``.
- DeepSeek-V2: the float32 softmax of float32 logits; with ``topk_method=
  group_limited_greedy`` only the experts of the ``top_groups`` groups (of ``groups``
  equal groups) whose best expert scores highest compete; the weights times
  ``routed_scaling_factor``, never renormalised.
- DeepSeek-V3: sigmoid scores of float32 logits; the choice ranks scores plus a learned
  ``e_score_correction_bias`` and keeps the ``top_groups`` groups whose two best experts
  add up highest; the weights are the chosen experts' scores without the bias,
  renormalised when ``normalize`` and times the scaling factor.

On the CPU with servelab's native ops, the softmax top-k without groups or bias is one
native call (``softmax_topk``: the decoder stack routes with it too), and the router's
matmul runs on a blocked copy of its weight (``float_linear``; ``bf16_linear`` for at
most ``BLOCKED_BFLOAT16_ROWS`` bfloat16 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from servelab.core.errors import ConfigError
from servelab.kernels.cpu_ops import native_cpu_available, native_cpu_enabled
from servelab.plugins.models.linear import BlockedCopy, blocked_matmul, blocked_rows, blocked_weight_runs

GROUP_SCORES = ("max", "top2_sum")
"""How a group of experts is scored: by its best expert (DeepSeek-V2), or by its two best
added up (DeepSeek-V3)."""


@dataclass(frozen=True, slots=True)
class Routing:
    """A router's rule (see the module docstring): ``scoring`` "softmax" or "sigmoid";
    ``groups`` equal groups of experts of which the best ``top_groups`` compete (1 and 1:
    every expert competes), each scored as ``group_score`` says; ``scale`` multiplies the
    weights; ``float32_logits`` computes the logits from float32 copies of the hidden state
    and router (DeepSeek's), else in the model's dtype; ``correction_bias``: the router has
    an ``e_score_correction_bias`` added to the scores it ranks."""

    top_k: int
    normalize: bool = False
    scoring: str = "softmax"
    groups: int = 1
    top_groups: int = 1
    group_score: str = "max"
    scale: float = 1.0
    float32_logits: bool = False
    correction_bias: bool = False

    def problems(self, num_experts: int, experts_field: str) -> list[str]:
        """What makes this rule impossible over ``num_experts`` experts (named
        ``experts_field`` in the config), each naming its fields; empty when it can run."""
        if not 1 <= self.top_k <= num_experts:
            return [f"num_experts_per_tok={self.top_k} must be in [1, {experts_field}={num_experts}]"]
        if self.groups == 1:
            return []
        if self.groups < 1 or num_experts % self.groups:
            return [f"n_group={self.groups} must divide {experts_field}={num_experts}"]
        per_group = num_experts // self.groups
        if not 1 <= self.top_groups <= self.groups:
            return [f"topk_group={self.top_groups} must be in [1, n_group={self.groups}]"]
        if self.top_k > self.top_groups * per_group:
            return [f"num_experts_per_tok={self.top_k} must be at most topk_group={self.top_groups} x "
                    f"{per_group} experts per group ({experts_field}={num_experts} / n_group={self.groups})"]
        if self.group_score == "top2_sum" and per_group < 2:
            return [f"n_group={self.groups} leaves one expert per group of {experts_field}={num_experts}; "
                    f"groups are scored by their two best experts"]
        return []

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] (and the correction bias [E]) -> (float32 weights [T, top_k],
        expert indices [T, top_k])."""
        if (self.scoring == "softmax" and self.groups == 1 and bias is None and logits.device.type == "cpu"
                and native_cpu_enabled() and native_cpu_available()):
            weights = logits.new_empty(logits.shape[0], self.top_k, dtype=torch.float32)
            experts = logits.new_empty(logits.shape[0], self.top_k, dtype=torch.long)
            torch.ops.servelab_cpu.softmax_topk(weights, experts, logits.contiguous(), self.top_k, self.normalize)
            return (weights * self.scale if self.scale != 1.0 else weights), experts
        if self.scoring == "sigmoid":
            scores = logits.float().sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = scores if bias is None else scores + bias.float()
        if self.groups > 1:
            grouped = choice.unflatten(-1, (self.groups, -1))
            if self.group_score == "top2_sum":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, torch.topk(group_scores, self.top_groups, dim=-1, sorted=False)[1], True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)
        experts = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.normalize:
            denominator = weights.sum(dim=-1, keepdim=True)
            weights = weights / (denominator + 1e-20 if self.scoring == "sigmoid" else denominator)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights, experts


class Router(nn.Module):
    """A sparse layer's router ``gate``: ``weight`` [experts, hidden], whole on every
    tensor-parallel rank, and (``routing.correction_bias``) ``e_score_correction_bias``
    [experts]; called on hidden states [T, hidden], returns (weights, experts) as
    ``Routing.route``."""

    def __init__(self, hidden_size: int, num_experts: int, routing: Routing):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self._blocked = BlockedCopy()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (float32 weights [T, top_k], expert indices [T, top_k])."""
        if self.routing.float32_logits:
            logits = F.linear(x.float(), self.weight.float())
        elif x.dtype == self.weight.dtype and blocked_rows(x.shape[0], x.dtype) and blocked_weight_runs(self.weight):
            logits = blocked_matmul(x, self.blocked_weight(), self.weight.shape[0])
        else:
            logits = F.linear(x, self.weight)
        return self.routing.route(logits, getattr(self, "e_score_correction_bias", None))

    def blocked_weight(self) -> torch.Tensor:
        """The weight's blocked copy (``BlockedCopy``), which the CPU's float32 logits and
        bfloat16 logits of a few rows multiply with."""
        return self._blocked.of(self.weight)


def checked(routing: Routing, num_experts: int, experts_field: str) -> Routing:
    """``routing``, or a ``ConfigError`` with its ``problems``."""
    problems = routing.problems(num_experts, experts_field)
    if problems:
        raise ConfigError(problems)
    return routing
