"""fused_moe (Triton grouped GEMM over experts) vs its per-expert torch reference, the
alignment step's padding, the layout of moe.py's stacked expert weights, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.kernels.fused_moe_reference import fused_moe_reference


@pytest.fixture
def moe():
    """The Triton module (imported lazily: skipped when triton is missing)."""
    return pytest.importorskip("servelab.kernels.fused_moe")


def make_inputs(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
                device: torch.device, ids: torch.Tensor | None = None) -> dict:
    """Random activations and expert weights (outputs of order one), random distinct
    experts per token unless ``ids`` is given, routing weights summing to one."""
    if ids is None:
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).reshape(tokens, top_k)
    weights = torch.rand(tokens, top_k) + 0.1
    return dict(
        x=torch.randn(tokens, hidden).to(dtype).to(device),
        gate_up=(torch.randn(experts, 2 * inter, hidden) * hidden ** -0.5).to(dtype).to(device),
        down=(torch.randn(experts, hidden, inter) * inter ** -0.5).to(dtype).to(device),
        topk_weights=(weights / weights.sum(-1, keepdim=True)).to(device),
        topk_ids=ids.to(device),
    )


@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k", [
    (1, 32, 32, 4, 1),    # a single token: three experts get none
    (1, 64, 48, 8, 2),
    (7, 48, 64, 8, 2),    # hidden and intermediate not multiples of the tiles
    (20, 64, 32, 4, 2),   # some experts' runs cross a BLOCK_M edge
    (13, 32, 64, 6, 1),
])
def test_matches_reference_float32(moe, device, close, tokens, hidden, inter, experts, top_k):
    inputs = make_inputs(tokens, hidden, inter, experts, top_k, torch.float32, device)
    close(moe.fused_moe(**inputs), fused_moe_reference(**inputs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_reference_half(moe, device, close, dtype):
    inputs = make_inputs(11, 64, 32, 4, 2, dtype, device)
    out = moe.fused_moe(**inputs)
    assert out.dtype == dtype
    close(out, fused_moe_reference(**inputs))


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert(moe, device, close, top_k):
    """Expert 2 takes every token (more than one block); with k = 2 expert 0 takes them too."""
    ids = torch.tensor([[2, 0][:top_k]] * 19)
    inputs = make_inputs(19, 32, 32, 5, top_k, torch.float32, device, ids)
    close(moe.fused_moe(**inputs), fused_moe_reference(**inputs))


def test_zero_tokens(moe, device):
    inputs = make_inputs(0, 32, 32, 4, 2, torch.float32, device, torch.zeros(0, 2, dtype=torch.int64))
    out = moe.fused_moe(**inputs)
    assert out.shape == (0, 32)


def test_alignment_pads_each_expert_to_whole_blocks(moe):
    """Pairs grouped by expert in their order, each run padded to BLOCK_M with the sentinel."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # pairs 0..5; expert 2 gets none
    align = moe.align_by_expert(ids, 4, 4)
    assert int(align.num_tokens_post_padded) == 12
    assert align.sorted_token_ids[:12].tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert align.expert_ids[:3].tolist() == [0, 1, 3]
    assert align.expert_ids.shape[0] * 4 == align.sorted_token_ids.shape[0] >= 12


def test_custom_activation(moe, device, close):
    """A gelu-gated activation, passed to kernel and reference alike."""
    def gelu_and_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate) * up

    inputs = make_inputs(9, 32, 32, 4, 2, torch.float32, device)
    close(moe.fused_moe(**inputs, activation=gelu_and_mul), fused_moe_reference(**inputs, activation=gelu_and_mul))


def test_stacked_expert_weights_of_moe_block(moe, device, close):
    """Views of ExpertWeights' stacked parameters give what its CPU path computes; on a GPU
    (``TRITON_INTERPRET=0``) the module itself takes the kernel path and gives it too."""
    from servelab.core.model import ModelParallel
    from servelab.plugins.models.moe import ExpertLayout, ExpertWeights
    from servelab.plugins.models.routing import Routing

    layout = ExpertLayout(num_experts=6, routing=Routing(top_k=2, normalize=True), intermediate_size=40, sparse_layers=(0,))
    experts = ExpertWeights(layout, 32, ModelParallel(), 0, F.silu, True)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.2)
        x = torch.randn(10, 32)
        weights, chosen = torch.rand(10, 2), torch.stack([torch.randperm(6)[:2] for _ in range(10)])
        expected = experts(x, weights, chosen)
        out = moe.fused_moe(x.to(device), experts.gate_up_proj.weight.unflatten(0, (6, -1)).to(device),
                            experts.down_proj.weight.unflatten(0, (6, -1)).to(device), weights.to(device),
                            chosen.to(device))
        routed = experts.to(device)(x.to(device), weights.to(device), chosen.to(device))
    close(out, expected)
    close(routed, expected)


def test_rejects_bad_arguments(moe, device):
    inputs = make_inputs(4, 32, 32, 4, 2, torch.float32, device)
    bad = [
        ({"x": inputs["x"][:, :16]}, "gate_up must be"),                            # hidden mismatch
        ({"x": inputs["x"].half()}, "gate_up dtype"),                                # weight dtype != x dtype
        ({"x": inputs["x"].long()}, "x dtype"),
        ({"down": inputs["down"][:, :, :16]}, "down must be"),
        ({"gate_up": inputs["gate_up"][:, :63]}, "gate_up must be"),                # odd 2 * I
        ({"topk_ids": inputs["topk_ids"][:3]}, "topk_ids must be"),
        ({"topk_ids": inputs["topk_ids"].float()}, "int32 or int64"),
        ({"topk_weights": inputs["topk_weights"].half()}, "topk_weights must be float32"),
        ({"topk_weights": inputs["topk_weights"][:, :1]}, "topk_weights shape"),
        ({"topk_ids": inputs["topk_ids"] + 4}, r"topk_ids must be in \[0, 4\)"),
        ({"topk_ids": inputs["topk_ids"] - 4}, r"topk_ids must be in \[0, 4\)"),
    ]
    for override, message in bad:
        with pytest.raises(ValueError, match=message):
            moe.fused_moe(**{**inputs, **override})


def test_expert_parallel_ranks_add_up_to_every_expert(moe, device, close):
    """Under expert parallelism each rank passes its own experts (``first_expert``) and the
    step's pairs as routed; pairs of other ranks' experts add nothing, so the ranks' sums
    add up to the whole layer, a rank whose experts got no pair included."""
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]] * 4)  # experts 3-5 get none
    inputs = make_inputs(20, 32, 48, 6, 2, torch.float32, device, ids)
    parts = [moe.fused_moe(**{**inputs, "gate_up": inputs["gate_up"][held], "down": inputs["down"][held]},
                           first_expert=held.start)
             for held in (range(0, 2), range(2, 4), range(4, 6))]
    assert not parts[2].any()
    close(sum(parts), fused_moe_reference(**inputs))


def test_int8_experts_match_the_dequantized_reference(moe, device, close):
    """int8 experts with one scale per row (``quantize_int8`` per expert), as moe.py
    stores them, equal the reference over the dequantized weights."""
    from servelab.kernels.quantized_weights import dequantize_int8, quantize_int8

    inputs = make_inputs(13, 48, 32, 4, 2, torch.float32, device)
    quantized = {name: [quantize_int8(w) for w in inputs[name]] for name in ("gate_up", "down")}
    stacked = {name: torch.stack([q for q, _ in pairs]) for name, pairs in quantized.items()}
    scales = tuple(torch.stack([s for _, s in quantized[name]]) for name in ("gate_up", "down"))
    dequantized = {name: torch.stack([dequantize_int8(q, s, torch.float32) for q, s in pairs])
                   for name, pairs in quantized.items()}
    out = moe.fused_moe(**{**inputs, **stacked}, scales=scales)
    close(out, fused_moe_reference(**{**inputs, **dequantized}))
    with pytest.raises(ValueError, match="gate_up must be int8 with scales"):
        moe.fused_moe(**inputs, scales=scales)


@pytest.mark.parametrize("quantized", [False, True])
def test_moe_block_takes_the_kernel_under_expert_parallelism(moe, device, close, quantized):
    """ExpertWeights.fused (the CUDA path) of one expert-parallel rank, float or int8,
    gives what the module's CPU path gives for that rank."""
    from servelab.core.model import ModelParallel
    from servelab.core.quantization import WeightQuantization
    from servelab.plugins.models.moe import ExpertLayout, ExpertWeights
    from servelab.plugins.models.routing import Routing

    layout = ExpertLayout(num_experts=6, routing=Routing(top_k=2, normalize=True), intermediate_size=40,
                          sparse_layers=(0,))
    experts = ExpertWeights(layout, 32, ModelParallel(tp_rank=1, tp_size=2, expert_parallel=True), 0, F.silu, True)
    if quantized:
        experts.quantize_weights(WeightQuantization(bits=8, group_size=-1))
    assert experts.fused_kernel_runs()
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randint(-127, 128, param.shape) if param.dtype == torch.int8
                        else torch.rand(param.shape) * (0.01 if quantized else 0.4) - (0 if quantized else 0.2))
        x = torch.randn(10, 32)
        weights, chosen = torch.rand(10, 2), torch.stack([torch.randperm(6)[:2] for _ in range(10)])
        expected = experts(x, weights, chosen)
        got = experts.to(device).fused(x.to(device), weights.to(device), chosen.to(device))
    close(got, expected)
