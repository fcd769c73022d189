"""Pure-torch reference for the fused mixture-of-experts kernel (``fused_moe``): a plain
loop over experts, each multiplying the tokens routed to it in float32."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 * I] as [gate | up] -> silu(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor,
                        activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul) -> torch.Tensor:
    """Reference for ``fused_moe`` (same arguments): for each expert e, the tokens that chose
    it pass ``down[e] @ activation(gate_up[e] @ x)``, scaled by their routing weight and
    summed per token. Computes in float32 and casts to x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, choices = (topk_ids == expert).nonzero(as_tuple=True)
        if tokens.numel():
            hidden = activation(x[tokens].float() @ gate_up[expert].float().T)
            scaled = (hidden @ down[expert].float().T) * topk_weights[tokens, choices].float()[:, None]
            out.index_add_(0, tokens, scaled)
    return out.to(x.dtype)
