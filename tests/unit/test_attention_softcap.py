"""Soft-capped attention scores (AttentionSpec.softcap): the reference caps them as defined,
backends that cannot cap refuse, and attention=auto picks one that can."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from servelab.core.attention import AttentionSpec
from servelab.core.engine.registry import get_registry
from servelab.testing.attention_kit import build_backend, random_steps, run_steps

REGISTRY = get_registry()
SPEC = AttentionSpec(4, 2, 32, 0.4, torch.float32, torch.device("cpu"), softcap=2.0)


def test_the_reference_caps_scaled_scores_before_the_causal_mask():
    steps, num_blocks = random_steps([(0, 9)], SPEC, 16, seed=0)
    (out,) = run_steps(build_backend("naive", SPEC), steps, num_blocks, 16)
    tensors = steps[0][1]
    q, k, v = tensors["q"], tensors["k"].repeat_interleave(2, dim=1), tensors["v"].repeat_interleave(2, dim=1)
    scores = 2.0 * torch.tanh(torch.einsum("qhd,khd->hqk", q, k) * 0.4 / 2.0)
    scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))


@pytest.mark.parametrize("name", ["cpu", "flash"])
def test_backends_without_a_cap_refuse_it(name):
    entry = REGISTRY.get("attention", name)
    reasons = entry.cls.unsupported_reasons(OmegaConf.to_object(OmegaConf.structured(entry.config_cls)), SPEC)
    assert any("soft-cap" in reason and "softcap 2.0" in reason for reason in reasons), reasons


def test_auto_picks_a_backend_that_caps():
    entry = REGISTRY.get("attention", "auto")
    config = entry.cls.resolve(OmegaConf.structured(entry.config_cls), SPEC, REGISTRY)
    assert REGISTRY.spec_for_config("attention", config).name == "sdpa"
