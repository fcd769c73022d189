"""A mixture of experts on the roofline: which experts a step's tokens reach, and what a
sparse layer's MLP costs on its busiest device.

**Routing.** Expert e (from 0) has popularity w_e = (e + 1) ** -s / sum, s being
``MixtureOfExperts.routing_skew`` (0: uniform), or the share of the pairs a real run routed
to it (``MixtureOfExperts.popularity``, from a routing trace). A token picks ``top_k`` distinct experts;
the chance it picks e is taken as p_e = min(1, c w_e), c chosen so the p_e add up to
``top_k`` (uniform: p_e = k / E exactly). Tokens route independently, so among T tokens
expert e gets T p_e (token, expert) pairs on average and is activated (by at least one
token) with probability 1 - (1 - p_e) ** T: the expected number of distinct experts is
their sum, E (1 - (1 - k / E) ** T) when uniform (k for one token, E for many).

**Cost of a sparse layer** on one rank: the router matmul; the shared experts as a dense
gated MLP; the routed experts as a grouped GEMM that reads each activated expert's weights
once and spends the FLOPs of the pairs routed to it (``moe_up_proj``, ``moe_act``,
``moe_down_proj``). Without expert parallelism every rank holds every expert, its width
split over the tensor-parallel ranks, and runs all T tokens. With ``expert_parallel_size``
N (as many as the tensor-parallel ranks) rank r holds experts r E / N to (r + 1) E / N - 1
whole: the step's tokens are split N ways for the layer's MLP (the attention's all-reduce
becomes a reduce-scatter and the next all-gather, the same bytes), each rank sends its
tokens' ``top_k`` copies to the experts' ranks and gets their outputs back (two all-to-alls,
priced as ``collectives.all_gather_time``), and the step waits for the rank with the most expected
pairs: rank 0, holding the most popular experts, when routing is skewed; under a trace,
whichever rank's experts drew the most. The load's
variance around its expectation is not priced.
"""

from __future__ import annotations

from functools import lru_cache

from servelab.core.model import MixtureOfExperts
from servelab.plugins.cost_model.operators import Operator, Widths, elementwise, matmul


@lru_cache(maxsize=64)
def pick_probabilities(moe: MixtureOfExperts) -> tuple[float, ...]:
    """Per expert, the probability that one token picks it (module docstring): ``top_k``
    in all, none above 1."""
    weights = list(moe.popularity) or [(e + 1) ** -moe.routing_skew for e in range(moe.num_experts)]
    picks = [0.0] * moe.num_experts
    capped: set[int] = set()
    while True:  # water-filling: experts that would exceed 1 are capped at 1, the rest share the remainder
        free = [e for e in range(moe.num_experts) if e not in capped]
        scale = (moe.top_k - len(capped)) / sum(weights[e] for e in free)
        over = {e for e in free if scale * weights[e] > 1.0}
        if not over:
            for e in free:
                picks[e] = scale * weights[e]
            for e in capped:
                picks[e] = 1.0
            return tuple(picks)
        capped |= over


def expected_active(moe: MixtureOfExperts, num_tokens: int, experts: range | None = None) -> float:
    """Expected distinct experts among ``experts`` (default: all) that ``num_tokens`` tokens activate."""
    picks = pick_probabilities(moe)
    return sum(1.0 - (1.0 - picks[e]) ** num_tokens for e in experts or range(moe.num_experts))


def busiest_experts(moe: MixtureOfExperts, expert_parallel_size: int) -> range:
    """The experts of the rank with the most expected pairs, of ``expert_parallel_size``
    equal consecutive ranges (the first under a skew, whose popularity falls with the
    index; any under a trace's)."""
    size, picks = moe.num_experts // expert_parallel_size, pick_probabilities(moe)
    ranks = [range(r * size, (r + 1) * size) for r in range(expert_parallel_size)]
    return max(ranks, key=lambda held: sum(picks[e] for e in held))


def sparse_mlp_operators(num_tokens: int, w: Widths, moe: MixtureOfExperts, tp: int, ep: int) -> list[Operator]:
    """A sparse layer's MLP on its busiest rank for a step of ``num_tokens`` tokens, split
    over ``tp`` tensor-parallel and ``ep`` expert-parallel ranks (1 or ``tp``; module docstring)."""
    n, h = -(-num_tokens // ep), w.hidden  # the tokens this rank routes
    split = tp // ep  # ranks sharing each expert's width
    held = busiest_experts(moe, ep)
    picks = pick_probabilities(moe)
    pairs = num_tokens * sum(picks[e] for e in held)
    active = expected_active(moe, num_tokens, held)
    width = moe.expert_intermediate_size // split
    weight = w.linear_weight_bytes(h)
    operators = [matmul("moe_router", n, h, moe.num_experts, w)]
    if moe.shared_intermediate_size:
        shared = moe.shared_intermediate_size // split
        operators += [matmul("moe_shared_up_proj", n, h, 2 * shared, w),
                      elementwise("moe_shared_act", n * shared, 2, 1, w, 5.0),
                      matmul("moe_shared_down_proj", n, shared, h, w)]
    return operators + [
        Operator("moe_up_proj", 2.0 * pairs * h * 2 * width,
                 active * h * 2 * width * weight + pairs * (h + 2 * width) * w.ab),
        elementwise("moe_act", pairs * width, 2, 1, w, 5.0),
        Operator("moe_down_proj", 2.0 * pairs * width * h,
                 active * width * h * w.linear_weight_bytes(width) + pairs * (width + h) * w.ab),
    ]


def dispatch_bytes(num_tokens: int, w: Widths, moe: MixtureOfExperts, ep: int) -> float:
    """Bytes one of ``ep`` ranks sends in one all-to-all of a sparse layer: its tokens'
    ``top_k`` copies of the hidden state."""
    return -(-num_tokens // ep) * moe.top_k * w.hidden * w.ab
