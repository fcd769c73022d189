"""Quantized weights end to end on a tiny model: logits within a tolerance of the float
model's, greedy agreement reported, a saved folder that loads to the same logits as
quantizing at load, tensor- and pipeline-parallel shards equal to one device, clear
start-up errors."""

from __future__ import annotations

import pytest
import torch

from servelab import ConfigError, LLM, SamplingParams
from servelab.core.entrypoints.quantize import save_quantized
from servelab.plugins.models.quantized_linear import QuantizedLinear
from servelab.kernels.w8a8_cpu import w8a8_unavailable_reason
from servelab.testing import assert_no_leaked_blocks, mixed_prompts

BASE = ["model.dtype=float32", "device=cpu"]
MODES = {"int8": ["model.quantization=int8"],
         "w8a8": ["model.quantization=w8a8"],
         "int8+head": ["model.quantization=int8", "model.quantization_lm_head=true"],
         "int4": ["model.quantization=int4", "model.quantization_group_size=32"],
         "int4+head": ["model.quantization=int4", "model.quantization_group_size=32", "model.quantization_lm_head=true"],
         "w4a8": ["model.quantization=w4a8", "model.quantization_group_size=32"],
         "int4+head4": ["model.quantization=int4", "model.quantization_group_size=32", "model.quantization_lm_head=int4"],
         "w4a8+head4": ["model.quantization=w4a8", "model.quantization_group_size=32", "model.quantization_lm_head=int4"]}
# Relative error of the logits (Frobenius norm of the difference over the float logits')
# on the tiny random Llama: measured 0.0070 (int8), 0.0090 (w8a8), 0.0092 (int8 with the
# LM head) and 0.0843 (int4, groups of 32) on 2026-12-01; 0.117 with the int4 LM head too
# (int4 and w4a8, groups of 32) on 2026-12-06.
LOGIT_TOLERANCE = {"int8": 0.015, "w8a8": 0.02, "int8+head": 0.02, "int4": 0.12, "int4+head": 0.12, "w4a8": 0.12,
                   "int4+head4": 0.15, "w4a8+head4": 0.15}
MIXTURE_W8A8_TOLERANCE = 0.05
"""The tiny Qwen2-MoE's w8a8 logits against its float ones (measured 2026-12-04: see the
test's output)."""
needs_w8a8 = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))
PROMPTS = mixed_prompts(200, lengths=(5, 23, 40, 11))


def prompt_logits(llm: LLM, prompts=PROMPTS) -> list[torch.Tensor]:
    """float32 logits [len(prompt), V] at every position of each prompt (its prefill step)."""
    model = llm.engine.executor.model
    original = model.compute_logits
    captured: list[torch.Tensor] = []
    model.compute_logits = lambda hidden: captured.append(original(hidden)) or captured[-1]
    try:
        rows = []
        for prompt in prompts:
            captured.clear()
            llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            assert captured[0].shape[0] == len(prompt)
            rows.append(captured[0].clone())
        return rows
    finally:
        del model.compute_logits


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """Each prompt token's logprob (after the first), all prompts concatenated."""
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry[token].logprob for prompt, output in zip(PROMPTS, outputs)
                         for token, entry in zip(prompt[1:], output.prompt_logprobs[1:])])


def greedy(llm: LLM, tokens: int = 16) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llama):
    """The float model's logits and greedy tokens."""
    llm = LLM(llama, overrides=BASE)
    return prompt_logits(llm), greedy(llm)


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=needs_w8a8) if mode.startswith(("w8a8", "w4a8")) else mode
                                  for mode in MODES])
def test_logits_stay_close_to_the_float_model(llama, reference, mode):
    llm = LLM(llama, overrides=[*BASE, *MODES[mode]])
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4, "q/k/v, o, gate/up and down of both layers are quantized"
    assert all(layer.packed_kernel_weights(torch.empty(0)) is not None for layer in layers)
    float_logits, float_tokens = reference
    logits = prompt_logits(llm)
    got, expected = torch.cat(logits), torch.cat(float_logits)
    relative = float((got - expected).norm() / expected.norm())
    top1 = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    tokens = greedy(llm)
    same = sum(a == b for g, e in zip(tokens, float_tokens) for a, b in zip(g, e)) / sum(map(len, float_tokens))
    print(f"{mode}: logits relative error {relative:.4f}, teacher-forced top-1 agreement {top1:.3f}, "
          f"greedy tokens equal to float {same:.3f}")
    assert relative < LOGIT_TOLERANCE[mode]
    assert top1 >= 0.5
    assert_no_leaked_blocks(llm)


def test_a_saved_folder_loads_to_the_logits_of_quantizing_at_load(llama, tmp_path):
    folder = save_quantized(llama, str(tmp_path / "int4"), "int4", 32)
    saved = LLM(folder, overrides=BASE)
    at_load = LLM(llama, overrides=[*BASE, *MODES["int4"]])
    for got, expected in zip(prompt_logits(saved), prompt_logits(at_load)):
        assert torch.equal(got, expected)
    assert greedy(saved) == greedy(at_load)
    with pytest.raises(ConfigError, match="model.quantization=int8 but the checkpoint holds int4 weights"):
        LLM(folder, overrides=[*BASE, "model.quantization=int8"])


@needs_w8a8
def test_a_saved_int4_folder_serves_with_int8_activations(llama, tmp_path):
    folder = save_quantized(llama, str(tmp_path / "int4"), "int4", 32)
    saved = LLM(folder, overrides=[*BASE, "model.quantization=w4a8"])
    at_load = LLM(llama, overrides=[*BASE, *MODES["w4a8"]])
    for got, expected in zip(prompt_logits(saved), prompt_logits(at_load)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("mode, split, tolerance", [
    ("int8", "tensor_parallel_size", 1e-4), ("int4", "tensor_parallel_size", 1e-4),
    ("int4", "pipeline_parallel_size", 1e-4),
    # each rank quantizes its own share of the output and down projections' input rows
    pytest.param("w8a8", "tensor_parallel_size", 2e-2, marks=needs_w8a8),
    pytest.param("w4a8", "tensor_parallel_size", 2e-2, marks=needs_w8a8)])
def test_parallel_shards_equal_one_device(llama, mode, split, tolerance):
    one = prompt_logprobs(LLM(llama, overrides=[*BASE, *MODES[mode]]))
    llm = LLM(llama, overrides=[*BASE, *MODES[mode], f"parallel.{split}=2"])
    try:
        torch.testing.assert_close(prompt_logprobs(llm), one, atol=tolerance, rtol=tolerance)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("overrides, message", [
    (["model.quantization=int4"], "model.quantization_group_size=128 does not divide in_features=64 of "
                                  "model.layers.*.self_attn.q_proj"),
    (["model.quantization=int4", "model.quantization_group_size=64", "parallel.tensor_parallel_size=4"],
     "in_features=16 of model.layers.*.self_attn.o_proj \\(its share on each of 4 tensor-parallel ranks\\)"),
    (["model.quantization=fp4"], "model.quantization must be one of auto, none, int8, w8a8, int4, w4a8, got 'fp4'"),
    (["model.quantization=w4a8", "model.quantization_group_size=4"],
     "model.quantization=w4a8 needs model.quantization_group_size a multiple of 8, got 4"),
    (["model.quantization=int4", "executor=simulated"], "model.quantization_group_size=128 does not divide"),
    (["model.quantization=int8", "model.quantization_lm_head=int4"],
     "model.quantization_lm_head=int4 needs int4 layers \\(model.quantization=int4 or w4a8\\)"),
    (["model.quantization=int4", "model.quantization_lm_head=fp8"],
     "model.quantization_lm_head must be false, true \\(int8\\), int8 or int4, got 'fp8'"),
])
def test_bad_combinations_fail_at_start_up(llama, overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLM(llama, overrides=[*BASE, *overrides])


MIXTURES = ("qwen2-moe", "deepseek-v3")
"""Mixtures of experts quantized: Qwen2-MoE (a dense layer, routed experts, a gated shared
expert) and DeepSeek-V3 (latent attention, grouped routing, shared experts)."""


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory) -> dict[str, str]:
    """Tiny mixture-of-experts checkpoints, and each one's float copy whose quantized
    weights are replaced by what their int8 values stand for (``<family>-dequantized``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from servelab.core.quantization import is_quantized_tensor
    from servelab.kernels.quantized_weights import dequantize_int8, quantize_int8
    from servelab.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("quantized-moe")
    folders = {}
    for family in MIXTURES:
        folders[family] = tiny_checkpoint(root / family, family)
        copy = shutil.copytree(folders[family], root / f"{family}-dequantized")
        weights = load_file(copy / "model.safetensors")
        save_file({name: dequantize_int8(*quantize_int8(tensor), tensor.dtype) if is_quantized_tensor(name, tensor)
                   else tensor for name, tensor in weights.items()}, copy / "model.safetensors", metadata={"format": "pt"})
        folders[f"{family}-dequantized"] = str(copy)
    return folders


@pytest.mark.parametrize("family", MIXTURES)
def test_int8_experts_compute_what_their_int8_weights_stand_for(mixtures, family):
    """Every expert is stored in int8 and multiplies through the int8 kernel: the logits
    are the float model's on the dequantized weights (routing decisions included; the
    float model's own logits are no reference, a tiny mixture's routing flips on small
    changes). Routers, the shared expert's gate and MLA's kv_b_proj stay float."""
    from servelab.plugins.models.moe import QuantizedStackedWeight
    from servelab.plugins.models.routing import Router

    prompts = mixed_prompts(257, lengths=(5, 23, 40, 11))
    llm = LLM(mixtures[family], overrides=[*BASE, *MODES["int8"]])
    model = llm.engine.executor.model
    stacks = [m for m in model.modules() if isinstance(m, QuantizedStackedWeight)]
    assert len(stacks) == 2 and not any(m.int8_activations for m in stacks)
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, Router))
    assert all(layer.packed_kernel_weights(torch.empty(0)) is not None for stack in stacks for layer in stack.layers())
    got = torch.cat(prompt_logits(llm, prompts))
    expected = torch.cat(prompt_logits(LLM(mixtures[f"{family}-dequantized"], overrides=BASE), prompts))
    assert float((got - expected).norm() / expected.norm()) < 1e-4
    assert_no_leaked_blocks(llm)


@needs_w8a8
def test_w8a8_experts_stay_close_to_the_float_model(mixtures):
    from servelab.plugins.models.moe import QuantizedStackedWeight

    prompts = mixed_prompts(257, lengths=(5, 23, 40, 11))
    llm = LLM(mixtures["qwen2-moe"], overrides=[*BASE, *MODES["w8a8"]])
    assert all(m.int8_activations for m in llm.engine.executor.model.modules() if isinstance(m, QuantizedStackedWeight))
    got = torch.cat(prompt_logits(llm, prompts))
    expected = torch.cat(prompt_logits(LLM(mixtures["qwen2-moe"], overrides=BASE), prompts))
    relative = float((got - expected).norm() / expected.norm())
    print(f"qwen2-moe w8a8: logits relative error {relative:.4f}")
    assert relative < MIXTURE_W8A8_TOLERANCE


def test_a_saved_int8_mixture_loads_to_the_logits_of_quantizing_at_load(mixtures, tmp_path):
    """The folder holds each expert's qweight and scales (and float routers)."""
    folder = save_quantized(mixtures["qwen2-moe"], str(tmp_path / "int8"), "int8", 128)
    prompts = mixed_prompts(257, lengths=(5, 23))
    saved = prompt_logits(LLM(folder, overrides=BASE), prompts)
    at_load = prompt_logits(LLM(mixtures["qwen2-moe"], overrides=[*BASE, *MODES["int8"]]), prompts)
    assert all(torch.equal(got, expected) for got, expected in zip(saved, at_load))


@pytest.mark.parametrize("split", [["parallel.tensor_parallel_size=2"],
                                   ["parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2"]],
                         ids=["tp2", "tp2-ep2"])
def test_int8_experts_split_like_one_device(mixtures, split):
    """Each rank keeps its columns of every expert (a row's scale covers them all) or its
    experts whole."""
    folder = mixtures["qwen2-moe"]
    one = prompt_logprobs(LLM(folder, overrides=[*BASE, *MODES["int8"]]))
    llm = LLM(folder, overrides=[*BASE, *MODES["int8"], *split])
    try:
        torch.testing.assert_close(prompt_logprobs(llm), one, atol=1e-4, rtol=1e-4)
    finally:
        llm.engine.shutdown()


def test_int4_experts_are_refused_naming_the_field(mixtures):
    with pytest.raises(ConfigError, match=r"model.quantization: a mixture's experts are quantized to 8 bits only "
                                          r"\(int8 or w8a8\), not 4"):
        LLM(mixtures["qwen2-moe"], overrides=[*BASE, "model.quantization=int4", "model.quantization_group_size=32"])
