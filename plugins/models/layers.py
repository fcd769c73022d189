"""Building blocks shared by the decoder models: RMSNorm and rotary embeddings (the linear
layer is ``servelab.plugins.models.linear.Linear``; LayerNorm is torch's ``nn.LayerNorm``,
there is no native op for it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelab.core.errors import ConfigError
from servelab.kernels.cpu_ops import native_cpu_available


def use_native(x: torch.Tensor) -> bool:
    """True when ``x`` is on the CPU and servelab's native CPU ops are built."""
    return x.device.type == "cpu" and native_cpu_available()


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32, as the Llama family defines it.

    On the CPU, 2-D contiguous inputs take the native op, which rounds exactly where the
    torch formula does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size] -> same shape and dtype."""
        if x.dim() == 2 and x.is_contiguous() and use_native(x):
            out = torch.empty_like(x)
            torch.ops.servelab_cpu.rms_norm(out, x, self.weight, self.eps)
            return out
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual connection and the norm of its result: returns (norm(x + residual),
        x + residual). The native op reuses ``x`` and ``residual`` as outputs."""
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and use_native(x):
            torch.ops.servelab_cpu.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table over ``max_positions``.

    The inverse frequencies come from the checkpoint's ``rope_parameters`` (default,
    linear, llama3, yarn and longrope scaling), computed exactly as the reference
    implementation; ``partial_rotary_factor`` rotates the first ``rotary_dim`` features
    of each head and passes the rest through. longrope's short factors give the rows of
    positions below ``original_max_position_embeddings`` and its long factors the rest:
    transformers switches a whole forward pass to the long factors once its last position
    passes that length, which equals this table for prompts up to it (the decode steps
    past it rotate with the long factors in both).
    """

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError([f"rope_scaling.rope_type {rope_type!r} is not supported; supported: "
                               f"{', '.join(SUPPORTED_ROPE_TYPES)}"])
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * factor)
        positions = torch.arange(max_positions, dtype=torch.long)[:, None].float()
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            dim = self.rotary_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            freqs, scaling = positions * inv_freq.float(), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
            freqs = positions * inv_freq.float()
            if rope_type == "longrope":
                original = params["original_max_position_embeddings"]
                long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=original + 1)
                freqs[original:] = positions[original:] * long_freq.float()
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (table.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (table.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H, D]; k: [T, Hkv, D]. Returns rotated (q, k); the native
        CPU op rotates them in place (their first ``rotary_dim`` features)."""
        rot = self.rotary_dim
        if use_native(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            torch.ops.servelab_cpu.rotary_embedding(q[..., :rot], k[..., :rot], positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if rot == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        return (torch.cat((_rotate(q[..., :rot], cos, sin), q[..., rot:]), dim=-1),
                torch.cat((_rotate(k[..., :rot], cos, sin), k[..., rot:]), dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
