"""Conformance kit for attention backends: the same random flat batches through the
backend and through ``attention=naive``, the reference, within the dtype's tolerance;
also over one-byte KV caches (``cache.kv_dtype``) for backends that read them, and with
soft-capped scores (``AttentionSpec.softcap``) for backends that cap them, token trees
(``BatchLayout.tree``, ``copy_slots``) for backends that set ``reads_token_trees``, and
caches of keys alone whose values are the keys (``AttentionSpec.values_are_keys``, latent
attention)."""

from __future__ import annotations

from dataclasses import replace

import itertools
import math
from typing import Any

import pytest
import torch

from servelab.core.attention import AttentionSpec
from servelab.core.batch_builder import build_step_inputs
from servelab.core.kv_cache_dtype import quantized_kv_dtypes
from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams
from servelab.core.scheduler import ScheduledRequest
from servelab.testing.kit import ConformanceKit

SCENARIOS = {
    "prefill": [(0, 23), (0, 33), (0, 5)],
    "chunked_prefill": [(54, 16), (32, 13), (82, 8)],
    "decode": [(0, 1), (49, 1), (96, 1), (15, 1)],
    "speculative_verify": [(56, 4), (77, 4), (29, 4)],
    "mixed": [(56, 1), (0, 30), (76, 12), (60, 5)],
}
"""(tokens already cached, new tokens) per request of a step."""
BLOCK_SIZES = (1, 16, 128)
"""Paged block sizes; 128 holds a whole context in one block, the contiguous layout."""
HEADS = ((4, 4), (4, 2), (4, 1))
"""(query heads, KV heads): multi-head, grouped-query and multi-query."""
DTYPES = (torch.float32, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
"""Absolute and relative tolerance against the float32 reference, per dtype."""
HEAD_DIM = 32
SOFTCAP = 2.0
"""A soft cap below the typical scaled score (about 2.3 at ``SOFTCAP_SCALE``): capping changes the output."""
SOFTCAP_SCALE = 0.4
"""A softmax scale other than head_dim ** -0.5, as Gemma's ``query_pre_attn_scalar`` gives."""

CASES = [(scenario, block_size, HEADS[i % len(HEADS)], DTYPES[i % len(DTYPES)])
         for i, (block_size, scenario) in enumerate(itertools.product(BLOCK_SIZES, SCENARIOS))]
"""Every (block size, scenario) pair once, cycling the head layout and dtype through them."""
QUANTIZED_TOLERANCE = {torch.int8: 1e-2, getattr(torch, "float8_e4m3fn", torch.int8): 5e-2}
"""Tolerance against the reference over the same one-byte cache: a backend may round a
value to the neighbouring code (one int8 step is 1/127 of its row's largest value; fp8
keeps three mantissa bits)."""
QUANTIZED_CASES = [(scenario, kv_dtype, DTYPES[i % len(DTYPES)])
                   for i, (kv_dtype, scenario) in enumerate(itertools.product(
                       quantized_kv_dtypes(), ("chunked_prefill", "decode", "speculative_verify", "mixed")))]
"""Each one-byte cache dtype this torch has, under the scenarios that read cached keys."""
VALUES_ARE_KEYS_CASES = [("mixed", 16, torch.float32, None), ("decode", 1, torch.bfloat16, None),
                         ("chunked_prefill", 128, torch.bfloat16, None),
                         *(("speculative_verify", 16, torch.float32, kv_dtype) for kv_dtype in quantized_kv_dtypes())]
"""(scenario, block size, dtype, cache dtype) of the keys-alone cases: paged and
contiguous, float and one-byte caches, multi-query as latent attention runs."""


def case_id(case: tuple) -> str:
    """A readable test id: ``decode-bs16-gqa2-bfloat16``."""
    scenario, block_size, (heads, kv_heads), dtype = case
    return f"{scenario}-bs{block_size}-gqa{heads // kv_heads}-{str(dtype).removeprefix('torch.')}"


def build_backend(name: str, spec: AttentionSpec) -> Any:
    """The backend ``name`` (a selector resolved first) for ``spec``, or a skip naming why
    it cannot run here."""
    from omegaconf import OmegaConf

    from servelab.core.engine.registry import get_registry

    registry = get_registry()
    entry = registry.get("attention", name)
    config = entry.cls.resolve(OmegaConf.structured(entry.config_cls), spec, registry)
    chosen = registry.spec_for_config("attention", config)
    reasons = chosen.cls.unsupported_reasons(OmegaConf.to_object(config), spec)
    if reasons:
        pytest.skip(f"attention={name} cannot run here: {'; '.join(reasons)}")
    return registry.build("attention", config, spec)


def run_steps(backend: Any, steps: list[tuple[list[ScheduledRequest], dict]], num_blocks: int,
              block_size: int, trees: list | None = None, moves: tuple | None = None) -> list[torch.Tensor]:
    """Each step's outputs through ``backend``, over a fresh cache in its own layout; the
    last step with the token trees ``trees`` (one region per request, ``with_trees``)
    when given, after ``backend.copy_slots`` of ``moves`` (sources, destinations)."""
    from servelab.core.token_tree import with_trees

    spec = backend.spec
    kv_cache = torch.zeros(backend.kv_cache_shape(num_blocks, block_size), dtype=spec.cache_dtype)
    outputs = []
    for index, (grants, tensors) in enumerate(steps):
        inputs = build_step_inputs(grants, (), block_size, spec.device)
        if index == len(steps) - 1 and trees is not None:
            inputs = with_trees(inputs, trees)
        if index == len(steps) - 1 and moves is not None:
            backend.copy_slots(kv_cache, *(torch.tensor(slots) for slots in moves))
        meta = backend.build_metadata(inputs.layout)
        outputs.append(backend.forward(tensors["q"].clone(), tensors["k"].clone(), tensors["v"].clone(), kv_cache,
                                       meta, 0))
    return outputs


def random_steps(pairs: list[tuple[int, int]], spec: AttentionSpec, block_size: int, seed: int
                 ) -> tuple[list[tuple[list[ScheduledRequest], dict]], int]:
    """A step caching every request's context, then the step under test; shuffled block
    tables. Returns the steps (grants and random q/k/v) and the number of blocks."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-(cached + new) // block_size) for cached, new in pairs]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in blocks:
        tables.append(tuple(order[start:start + count]))
        start += count
    requests = [Request(f"r{i}", [0] * (cached + new), SamplingParams(), None) for i, (cached, new) in enumerate(pairs)]
    history = [ScheduledRequest(r, 0, cached, table, False)
               for r, (cached, _), table in zip(requests, pairs, tables) if cached]
    current = [ScheduledRequest(r, cached, new, table, True)
               for r, (cached, new), table in zip(requests, pairs, tables)]

    def tensors(grants: list[ScheduledRequest]) -> dict:
        tokens = sum(g.num_new_tokens for g in grants)
        shapes = {"q": spec.num_heads, "k": spec.num_kv_heads, "v": spec.num_kv_heads}
        return {key: torch.randn(tokens, heads, spec.head_dim, generator=generator).to(spec.dtype)
                for key, heads in shapes.items()}

    steps = [(grants, tensors(grants)) for grants in (history, current) if grants]
    return steps, num_blocks


def keys_as_values(steps: list[tuple[list[ScheduledRequest], dict]]) -> list[tuple[list[ScheduledRequest], dict]]:
    """``steps`` with every token's value replaced by its key, as latent attention passes them."""
    return [(grants, {**tensors, "v": tensors["k"]}) for grants, tensors in steps]


class AttentionConformance(ConformanceKit):
    """The ``AttentionBackend`` contract: prefill, chunked prefill, decode, speculative
    verification and mixed steps over paged and contiguous layouts, multi-head,
    grouped-query and multi-query, float32 and bfloat16, equal to ``attention=naive``; a
    backend that sets ``reads_quantized_kv`` also over int8 and fp8 caches; soft-capped
    scores with a non-default scale; a backend that sets ``reads_token_trees`` also token
    trees against attention computed from the keys themselves, and ``copy_slots``. A
    backend that reports ``unsupported_reasons`` for a case is skipped with them."""

    kind = "attention"

    @pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
    def test_matches_the_reference(self, component, case):
        scenario, block_size, (heads, kv_heads), dtype = case
        spec = AttentionSpec(heads, kv_heads, HEAD_DIM, HEAD_DIM ** -0.5, dtype, torch.device("cpu"))
        self.check(component, spec, SCENARIOS[scenario], block_size)

    @pytest.mark.parametrize("window", [7, 40])
    def test_sliding_window_matches_the_reference(self, component, window):
        spec = AttentionSpec(4, 2, HEAD_DIM, HEAD_DIM ** -0.5, torch.float32, torch.device("cpu"), window)
        self.check(component, spec, SCENARIOS["mixed"], 16)

    @pytest.mark.parametrize("window", [7, 40])
    def test_windowed_tables_with_placeholder_entries(self, component, window):
        """A windowed KV cache group's table points the entries wholly before the window
        of a step's first new token at a placeholder block (zeros, never written): the
        output is the one over the whole table."""
        spec = AttentionSpec(4, 2, HEAD_DIM, HEAD_DIM ** -0.5, torch.float32, torch.device("cpu"), window)
        backend, reference = build_backend(component, spec), build_backend("naive", spec)
        block_size = 16
        steps, num_blocks = random_steps(SCENARIOS["mixed"], spec, block_size, seed=window)
        *history, (grants, tensors) = steps
        placeholder = num_blocks
        windowed = [replace(grant, block_ids=tuple(
            placeholder if index < max(0, grant.num_computed_tokens - window + 1) // block_size else block
            for index, block in enumerate(grant.block_ids))) for grant in grants]
        assert windowed != grants, "no table entry lies wholly before a window"
        got = run_steps(backend, [*history, (windowed, tensors)], num_blocks + 1, block_size)[-1]
        wanted = run_steps(reference, steps, num_blocks, block_size)[-1]
        torch.testing.assert_close(got, wanted, atol=TOLERANCE[spec.dtype], rtol=TOLERANCE[spec.dtype])

    @pytest.mark.parametrize("scenario", ["mixed", "decode"])
    def test_soft_capped_scores_match_the_reference(self, component, scenario):
        spec = AttentionSpec(4, 2, HEAD_DIM, SOFTCAP_SCALE, torch.float32, torch.device("cpu"), softcap=SOFTCAP)
        self.check(component, spec, SCENARIOS[scenario], 16)

    @pytest.mark.parametrize("case", QUANTIZED_CASES,
                             ids=[f"{c[0]}-{str(c[1]).removeprefix('torch.')}-{str(c[2]).removeprefix('torch.')}"
                                  for c in QUANTIZED_CASES])
    def test_quantized_cache_matches_the_reference(self, component, case):
        scenario, kv_dtype, dtype = case
        spec = AttentionSpec(4, 2, HEAD_DIM, HEAD_DIM ** -0.5, dtype, torch.device("cpu"), kv_dtype=kv_dtype)
        self.check(component, spec, SCENARIOS[scenario], 16)

    @pytest.mark.parametrize("block_size", [1, 16])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_token_trees_read_only_their_ancestors(self, component, block_size, dtype):
        """Each new token of a token tree (``BatchLayout.tree``) attends to its request's
        context before the tree and to its ancestors and itself in the tree, computed
        here from the keys and values themselves: a verified tree (every node new), a
        drafted level (earlier nodes cached), one new node reading a tree of three, next
        to a plain decode and a prefill."""
        spec = AttentionSpec(4, 2, HEAD_DIM, HEAD_DIM ** -0.5, dtype, torch.device("cpu"))
        backend = build_backend(component, spec)
        if not backend.reads_token_trees:
            pytest.skip(f"attention={component} does not mask token trees (reads_token_trees is False)")
        trees = [[-1, 0, 0, 1, 2, 2, 1], None, [-1, -1, 0, 1, 1, 0], [-1, -1, 1], None]
        pairs = [(29, 7), (40, 1), (16, 3), (8, 1), (0, 9)]  # (cached, new); new tokens end each tree
        steps, num_blocks = random_steps(pairs, spec, block_size, seed=block_size)
        got = run_steps(backend, steps, num_blocks, block_size, trees)[-1]
        expected = tree_reference(spec, steps, pairs, trees)
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    @pytest.mark.parametrize("case", VALUES_ARE_KEYS_CASES,
                             ids=[f"{c[0]}-bs{c[1]}-{str(c[2]).removeprefix('torch.')}-{c[3] or 'same'}"
                                  .replace("torch.", "") for c in VALUES_ARE_KEYS_CASES])
    def test_values_read_out_of_the_keys(self, component, case):
        """A cache of keys alone (``AttentionSpec.values_are_keys``): half the elements of
        the backend's key-and-value cache, and every step's output equal to
        ``attention=naive`` over a key-and-value cache given each key as its value."""
        scenario, block_size, dtype, kv_dtype = case
        spec = AttentionSpec(4, 1, HEAD_DIM, HEAD_DIM ** -0.5, dtype, torch.device("cpu"), kv_dtype=kv_dtype,
                             values_are_keys=True)
        backend = build_backend(component, spec)
        if not backend.reads_values_from_keys:
            pytest.skip(f"attention={component} does not read values out of keys (reads_values_from_keys is False)")
        if spec.kv_quantized and not backend.reads_quantized_kv:
            pytest.skip(f"attention={component} does not read one-byte KV caches (reads_quantized_kv is False)")
        plain = replace(spec, values_are_keys=False)
        elements = [math.prod(b.kv_cache_shape(4, block_size)) for b in (backend, build_backend(component, plain))]
        assert 2 * elements[0] == elements[1], f"a cache of keys alone holds {elements[0]} elements, not half of {elements[1]}"
        steps, num_blocks = random_steps(SCENARIOS[scenario], spec, block_size, seed=block_size)
        steps = keys_as_values(steps)
        got = run_steps(backend, steps, num_blocks, block_size)
        wanted = run_steps(build_backend("naive", plain), steps, num_blocks, block_size)
        tolerance = max(TOLERANCE[dtype], QUANTIZED_TOLERANCE.get(spec.cache_dtype, 0.0))
        for step, (actual, expected) in enumerate(zip(got, wanted)):
            torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance,
                                       msg=lambda m: f"step {step}: {m}")

    def test_copy_slots_moves_keys_and_values(self, component):
        """``copy_slots`` moves a verified tree's kept nodes into place: a decode step
        after the copy reads what the reference reads after its own copy (also in a cache
        of keys alone)."""
        cases = [*((torch.float32, d, False) for d in (None, *quantized_kv_dtypes())),
                 (torch.bfloat16, None, False), (torch.float32, None, True)]
        for dtype, kv_dtype, values_are_keys in cases:
            spec = AttentionSpec(4, 2, HEAD_DIM, HEAD_DIM ** -0.5, dtype, torch.device("cpu"),
                                 kv_dtype=kv_dtype, values_are_keys=values_are_keys)
            backend = build_backend(component, spec)
            if not backend.reads_token_trees:
                pytest.skip(f"attention={component} does not move token trees (reads_token_trees is False)")
            if (spec.kv_quantized and not backend.reads_quantized_kv) or \
                    (values_are_keys and not backend.reads_values_from_keys):
                continue
            reference = build_backend("naive", replace(spec, values_are_keys=False))
            steps, num_blocks = random_steps([(30, 1), (12, 1)], spec, 4, seed=3)
            steps = keys_as_values(steps) if values_are_keys else steps
            tables = [grant.block_ids for grant in steps[-1][0]]
            slot = lambda r, p: tables[r][p // 4] * 4 + p % 4  # noqa: E731
            moves = ([slot(0, 27), slot(0, 29), slot(1, 9)], [slot(0, 21), slot(0, 22), slot(1, 4)])
            got = run_steps(backend, steps, num_blocks, 4, moves=moves)[-1]
            wanted = run_steps(reference, steps, num_blocks, 4, moves=moves)[-1]
            tolerance = max(TOLERANCE[spec.dtype], QUANTIZED_TOLERANCE.get(spec.cache_dtype, 0.0))
            torch.testing.assert_close(got, wanted, atol=tolerance, rtol=tolerance)

    @staticmethod
    def check(name: str, spec: AttentionSpec, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Both backends on the same steps; every step's output within tolerance."""
        backend = build_backend(name, spec)
        if spec.kv_quantized and not backend.reads_quantized_kv:
            pytest.skip(f"attention={name} does not read one-byte KV caches (reads_quantized_kv is False)")
        reference = build_backend("naive", spec)
        steps, num_blocks = random_steps(pairs, spec, block_size, seed=hash((tuple(pairs), block_size)) % 2**31)
        got = run_steps(backend, steps, num_blocks, block_size)
        expected = run_steps(reference, steps, num_blocks, block_size)
        tolerance = max(TOLERANCE[spec.dtype], QUANTIZED_TOLERANCE.get(spec.cache_dtype, 0.0))
        for step, (actual, wanted) in enumerate(zip(got, expected)):
            assert actual.shape == wanted.shape and actual.dtype == spec.dtype
            assert not torch.isnan(actual).any(), f"step {step}: NaN in the output"
            torch.testing.assert_close(actual.float(), wanted.float(), atol=tolerance, rtol=tolerance,
                                       msg=lambda m: f"step {step} of {pairs}: {m}")


def tree_reference(spec: AttentionSpec, steps: list, pairs: list[tuple[int, int]], trees: list) -> torch.Tensor:
    """The last step's attention output [T, H, D] in float32, from the steps' keys and values:
    each new token reads its request's tokens before its tree, and its ancestors and
    itself in the tree (a request without a tree: causal)."""
    from servelab.core.token_tree import ancestor_mask

    *history, (_, current) = steps
    cached_k = history[0][1]["k"].float() if history else None
    cached_v = history[0][1]["v"].float() if history else None
    group = spec.num_heads // spec.num_kv_heads
    out, old, new = [], 0, 0
    for (cached, count), tree in zip(pairs, trees):
        keys = torch.cat([cached_k[old:old + cached], current["k"][new:new + count].float()]) if cached else \
            current["k"][new:new + count].float()
        values = torch.cat([cached_v[old:old + cached], current["v"][new:new + count].float()]) if cached else \
            current["v"][new:new + count].float()
        total = cached + count
        allowed = torch.ones(count, total, dtype=torch.bool).tril(cached)
        if tree:
            size = len(tree)
            allowed[:, total - size:] = torch.from_numpy(ancestor_mask(tree)[size - count:])
        query = current["q"][new:new + count].float()
        scores = torch.einsum("qhd,khd->hqk", query, keys.repeat_interleave(group, dim=1)) * spec.scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(group, dim=1)))
        old, new = old + cached, new + count
    return torch.cat(out)
