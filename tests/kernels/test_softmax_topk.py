"""The native softmax top-k routing (``softmax_topk``, csrc/softmax_topk.cpp) that the CPU
router and the native decoder stack share: the experts and weights of torch's softmax,
topk and renormalisation, ties to the lower expert, and errors that name the argument."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.cpu_ops import native_cpu_ops, native_cpu_unavailable_reason
from servelab.plugins.models.routing import Routing

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")


def routed(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.empty(logits.shape[0], top_k)
    experts = torch.empty(logits.shape[0], top_k, dtype=torch.long)
    native_cpu_ops().softmax_topk(weights, experts, logits, top_k, normalize)
    return weights, experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (48, 4), (5, 5), (60, 1)])
def test_matches_torch_softmax_topk(dtype, normalize, experts, top_k):
    torch.manual_seed(experts * top_k)
    logits = (3 * torch.randn(37, experts)).to(dtype)
    weights, chosen = routed(logits, top_k, normalize)
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    expected_weights, expected = scores.topk(top_k, dim=-1)
    if normalize:
        expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True)
    assert torch.equal(chosen, expected)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert_and_no_rows_is_fine():
    weights, chosen = routed(torch.tensor([[1.0, 3.0, 3.0, 1.0, 3.0]]), 4, True)
    assert chosen.tolist() == [[1, 2, 4, 0]]
    picked = torch.tensor([[3.0, 3.0, 3.0, 1.0]]).exp()
    torch.testing.assert_close(weights, picked / picked.sum())
    assert routed(torch.empty(0, 6), 2, False)[1].shape == (0, 2)


def test_the_router_routes_with_it():
    """``Routing.route`` on CPU logits gives the native op's answer, scaled after."""
    logits = torch.randn(9, 16)
    weights, chosen = Routing(top_k=3, normalize=True, scale=2.5).route(logits)
    expected_weights, expected = routed(logits, 3, True)
    assert torch.equal(chosen, expected) and torch.equal(weights, expected_weights * 2.5)


def test_refuses_bad_arguments():
    with pytest.raises(RuntimeError, match=r"top_k must be in \[1, 4\], got 5"):
        routed(torch.randn(2, 4), 5, False)
    with pytest.raises(RuntimeError, match="weights must be a contiguous float32"):
        native_cpu_ops().softmax_topk(torch.empty(2, 2).double(), torch.empty(2, 2, dtype=torch.long),
                                      torch.randn(2, 4), 2, False)
