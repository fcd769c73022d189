"""Triton kernel: the routed experts of a mixture-of-experts layer as one grouped GEMM per
projection, in the style of the well-known fused MoE kernels.

``align_by_expert`` sorts the step's (token, choice) pairs by expert and pads each expert's
run to a multiple of BLOCK_M, so every BLOCK_M rows of ``sorted_token_ids`` belong to one
expert (``expert_ids``, one per block). A program of ``_fused_moe_kernel`` takes one
[BLOCK_M, BLOCK_N] tile of one block: it gathers its pairs' activation rows by index,
multiplies them by that expert's weight tile and writes each result (optionally times the
pair's routing weight) to the pair's row. ``fused_moe`` runs it for gate/up, applies the
activation in torch, runs it for down with the routing weights, and sums each token's top-k
rows. Nothing here reads tensor values on the host unless ``check_expert_ids``.

Under expert parallelism (``first_expert``) the weights are one rank's experts and the
pairs routed to other ranks' experts are grouped after the last of them, where no program
reads them; they add nothing. int8 experts (``scales``) are multiplied as stored and
their per-row scales applied to each tile's float32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from servelab.kernels._checks import FLOAT_DTYPES, check, check_runnable, check_same_device, next_pow2
from servelab.kernels._triton_utils import check_launchable, dot_flags, mma
from servelab.kernels.availability import triton_interpret_enabled
from servelab.kernels.fused_moe_reference import silu_and_mul


@dataclass(frozen=True, slots=True)
class ExpertAlignment:
    """The (token, choice) pairs grouped by expert, each expert's run padded to ``block_m``.

    sorted_token_ids: int32 [max_blocks * block_m], pair indices (token * top_k + choice),
    the padding ``num_pairs``; expert_ids: int32 [max_blocks], the expert of each block
    (blocks past the end repeat the last expert); num_tokens_post_padded: int32 [1], the
    padded length actually used (blocks from there on are skipped).
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    num_pairs: int
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    first_expert: int | None = None) -> ExpertAlignment:
    """Sort the pairs of ``topk_ids`` [T, k] by expert (stable) and pad each expert's run to
    a multiple of ``block_m``, with torch ops on ``topk_ids``' device and no host sync (the
    block count is the bound cdiv(pairs, block_m) + min(pairs, experts + 1)). With
    ``first_expert`` the experts are ids ``first_expert`` to ``first_expert + num_experts
    - 1``; pairs routed elsewhere go to a last group past ``num_tokens_post_padded``."""
    flat = topk_ids.flatten().long()
    if first_expert is not None:
        flat = flat - first_expert
        flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    num_pairs, device = flat.numel(), flat.device
    groups = num_experts + (first_expert is not None)
    counts = torch.zeros(groups, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_pairs, groups)
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[sorted_experts] + rank] = order.int()
    starts = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1).int()
    return ExpertAlignment(sorted_ids, expert_ids, padded_end[num_experts - 1:num_experts].int(), num_pairs, block_m)


@triton.jit
def _fused_moe_kernel(
    a_ptr, w_ptr, scales_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    N, K, num_pairs,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, cols] = a[pair // TOP_K] @ w[expert, cols].T (times the pair's routing
    weight when WEIGHTED; int8 ``w`` times its rows' scales when SCALED) for one BLOCK_M
    block of sorted pairs and one BLOCK_N column tile."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    pairs = pairs.to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = a_ptr + (pairs // TOP_K) * stride_am
    w_cols = w_ptr + expert * stride_we + cols * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols[None, :] + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += mma(a, w.to(a.dtype), DOT_PRECISION, DOT_UPCAST)
    if SCALED:
        acc = acc * tl.load(scales_ptr + expert * stride_se + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def tile_sizes(num_pairs: int, num_experts: int) -> dict:
    """BLOCK_M near the mean pairs per expert (16 to 64: less padding in decode steps),
    64-wide N and K tiles; small tiles in the interpreter, so tests cross tile edges."""
    if triton_interpret_enabled():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=1)
    block_m = min(64, max(16, next_pow2(-(-num_pairs // num_experts))))
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def _expert_matmul(a: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor,
                   align: ExpertAlignment, topk_weights: torch.Tensor, top_k: int, weighted: bool,
                   tiles: dict) -> None:
    """Launch one grouped GEMM: ``out[pair] = a[pair // top_k] @ weight[expert(pair)].T``
    (int8 ``weight`` times ``scales`` [E, N] when given)."""
    n, k = weight.shape[1:]
    grid = (align.expert_ids.shape[0], triton.cdiv(n, tiles["BLOCK_N"]))
    _fused_moe_kernel[grid](
        a, weight, scales if scales is not None else a, out, topk_weights, align.sorted_token_ids,
        align.expert_ids, align.num_tokens_post_padded,
        n, k, align.num_pairs,
        a.stride(0), weight.stride(0), weight.stride(1), scales.stride(0) if scales is not None else 0, out.stride(0),
        TOP_K=top_k, WEIGHTED=weighted, SCALED=scales is not None, **dot_flags(a.dtype), **tiles,
    )


def _check_inputs(x, gate_up, down, topk_weights, topk_ids, check_expert_ids: bool,
                  scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] and contiguous in H, got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    tokens, hidden = x.shape
    check(gate_up.dim() == 3 and gate_up.shape[2] == hidden and gate_up.shape[1] % 2 == 0,
          f"gate_up must be [E, 2 * I, H={hidden}], got {tuple(gate_up.shape)}")
    experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    check(down.shape == (experts, hidden, intermediate),
          f"down must be [E={experts}, H={hidden}, I={intermediate}], got {tuple(down.shape)}")
    for index, (name, w) in enumerate((("gate_up", gate_up), ("down", down))):
        if scales is None:
            check(w.dtype == x.dtype, f"{name} dtype {w.dtype} != x dtype {x.dtype}")
        else:
            check(w.dtype == torch.int8, f"{name} must be int8 with scales, got {w.dtype}")
            check(scales[index].shape == w.shape[:2] and scales[index].stride(-1) == 1,
                  f"{name} scales must be [E, {w.shape[1]}] and contiguous, got {tuple(scales[index].shape)}")
        check(w.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == tokens and topk_ids.shape[1] >= 1,
          f"topk_ids must be [T={tokens}, k], got {tuple(topk_ids.shape)}")
    check(topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check(topk_weights.shape == topk_ids.shape,
          f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    check(topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}")
    check(topk_weights.is_contiguous(), "topk_weights must be contiguous")
    check_same_device(x.device, gate_up=gate_up, down=down, topk_weights=topk_weights, topk_ids=topk_ids,
                      **({"gate_up_scales": scales[0], "down_scales": scales[1]} if scales is not None else {}))
    if check_expert_ids and topk_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids))
        check(lo >= 0 and hi < experts, f"topk_ids must be in [0, {experts}), got values in [{lo}, {hi}]")


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
              check_expert_ids: bool = True, first_expert: int | None = None,
              scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype: each token's experts ``down[e] @ activation(gate_up[e]
    @ x)`` weighted by ``topk_weights`` and summed.

    gate_up: [E, 2 * I, H] ([gate | up] rows per expert); down: [E, H, I], both x's dtype
    (views of ``StackedWeight`` parameters work); topk_weights: float32 [T, k]; topk_ids:
    int32/int64 [T, k]; activation: [P, 2 * I] -> [P, I] (P = T * k), SiLU-and-multiply by
    default. ``check_expert_ids`` reads the ids (one host sync) to refuse ids outside [0, E);
    callers whose ids come from a top-k over E scores pass False. ``first_expert`` (expert
    parallelism): the weights are the router's experts ``first_expert`` to ``first_expert
    + E - 1`` and pairs routed to any other expert add nothing (no id is refused then).
    ``scales``: int8 ``gate_up`` and ``down`` with one scale per output row, [E, 2 * I]
    and [E, H] (``quantize_int8``'s per expert), applied to the float32 sums. Products
    accumulate in float32; float32 inputs multiply in IEEE float32 (no TF32).
    """
    _check_inputs(x, gate_up, down, topk_weights, topk_ids, check_expert_ids and first_expert is None, scales)
    check_runnable(x.device)
    check_launchable(_fused_moe_kernel, x.device)
    tokens, hidden = x.shape
    experts, top_k, intermediate = gate_up.shape[0], topk_ids.shape[1], down.shape[2]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = tile_sizes(num_pairs, experts)
    align = align_by_expert(topk_ids, experts, tiles["BLOCK_M"], first_expert)
    gate_up_scales, down_scales = scales if scales is not None else (None, None)
    gate_up_out = torch.empty(num_pairs, 2 * intermediate, dtype=x.dtype, device=x.device)
    _expert_matmul(x, gate_up, gate_up_scales, gate_up_out, align, topk_weights, top_k, False, tiles)
    hidden_states = activation(gate_up_out)
    check(hidden_states.shape == (num_pairs, intermediate) and hidden_states.dtype == x.dtype
          and hidden_states.stride(-1) == 1,
          f"activation must return a contiguous [{num_pairs}, {intermediate}] {x.dtype} tensor")
    # pairs of other ranks' experts are never written: they add zeros
    out = (torch.empty if first_expert is None else torch.zeros)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _expert_matmul(hidden_states, down, down_scales, out, align, topk_weights, 1, True, tiles)
    return out.view(tokens, top_k, hidden).sum(dim=1)
