"""The native decoder stack (``decode_layers``): the decode steps of plain Llama-shaped
float32 and bfloat16 models and of mixtures of experts (Mixtral, Qwen3-MoE) on ``attention=cpu`` run
their layers in one native call, with the same tokens, log-probabilities (to the bit) and
expert load as the Python layer loop, and greedy output equal to transformers; models and
steps it does not serve take the loop."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.kernels.cpu_ops import native_cpu_available
from servelab.kernels.w8a8_cpu import w8a8_unavailable_reason
from servelab.plugins.models.moe import routed_pairs
from servelab.plugins.models import quantized_linear
from servelab.plugins.models.native_decode_stack import INT4, INT4_SLICED, INT8, INT8_SLICED, NativeDecodeStack
from servelab.testing.oracle import assert_engine_matches_transformers, mixed_prompts, tiny_checkpoint

pytestmark = pytest.mark.skipif(not native_cpu_available(), reason="native CPU ops are not built here")

BASE = ["device=cpu", "attention=cpu", "cache=paged", "cache.block_size=16"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    made = {family: tiny_checkpoint(root / family, family)
            for family in ("llama", "qwen2", "qwen3", "mixtral", "qwen2-moe", "deepseek-v3")}
    made["qwen3-moe"] = tiny_checkpoint(root / "qwen3-moe", "qwen3-moe", mlp_only_layers=[1])  # dense and sparse
    return made


class CountingStack(NativeDecodeStack):
    """The stack, counting the steps it serves (the whole model's, its layers', or a
    greedy step's with its token chosen in the call)."""

    served = 0
    with_head = 0

    def model_hidden(self, *args):
        CountingStack.served += 1
        hidden, logits = super().model_hidden(*args)
        CountingStack.with_head += logits is not None
        return hidden, logits

    def __call__(self, *args):
        CountingStack.served += 1
        return super().__call__(*args)

    def greedy_steps(self, *args):
        tokens = super().greedy_steps(*args)
        CountingStack.served += tokens is not None
        CountingStack.with_head += tokens is not None
        return tokens


def counted(llm) -> type[CountingStack]:
    """Put a counting stack in the engine's model (asserting the stack serves it)."""
    model = llm.engine.executor.worker.model
    model._native_stack = CountingStack.of(model)
    assert model._native_stack is not None, "the native stack does not serve this model"
    CountingStack.served = CountingStack.with_head = 0
    return CountingStack


def sampled(llm, prompts) -> list[tuple]:
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    return [(o.outputs[0].token_ids, [sorted(step.items()) for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "qwen3-moe"])
def test_greedy_output_equals_transformers_through_the_stack(checkpoints, family):
    """Llama, Qwen2 (biased qkv projection), Qwen3 (q/k norms), Mixtral and Qwen3-MoE (a
    dense layer among the sparse ones), chunked so that later chunks also read the cache."""
    llm = LLM(checkpoints[family], overrides=[*BASE, "model.dtype=float32", "scheduler=chunked",
                                              "scheduler.token_budget=24"])
    try:
        stack = counted(llm)
        assert_engine_matches_transformers(checkpoints[family], llm=llm)
        assert stack.served > 10
    finally:
        llm.shutdown()


W8A8 = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))


@pytest.mark.parametrize("family, dtype, quantization", [
    ("llama", "float32", "none"), ("llama", "float32", "int8"), pytest.param("llama", "float32", "w8a8", marks=W8A8),
    ("llama", "float32", "int4"), pytest.param("llama", "float32", "w4a8", marks=W8A8),
    ("qwen3", "float32", "none"), ("mixtral", "float32", "none"),
    ("qwen3-moe", "float32", "int8"), pytest.param("qwen3-moe", "float32", "w8a8", marks=W8A8),
    ("qwen2", "bfloat16", "none"), ("qwen3", "bfloat16", "none"), ("mixtral", "bfloat16", "none"),
    ("qwen3-moe", "bfloat16", "none"), ("qwen2", "float32", "int8+head"),
    pytest.param("llama", "float32", "w8a8+head", marks=W8A8),
    ("llama", "float32", "int8 widened"), ("qwen3-moe", "float32", "int8 widened"),
    ("qwen2", "float32", "int8+head widened"), ("llama", "float32", "int4 widened"), ("qwen2", "float32", "int4+head4"),
    pytest.param("qwen2", "float32", "w4a8+head4", marks=W8A8)])
def test_the_stack_equals_the_layer_loop_to_the_bit(checkpoints, family, dtype, quantization, monkeypatch):
    """Same tokens and log-probabilities with the stack (decode steps whole: embedding,
    layers, final norm and LM head in its call) and with the Python loop, in float32
    and with every weight-quantization kernel (int4 and w4a8 in groups of 32: the model is
    narrow; the int8 LM head, weight-only and w8a8, and the int4 one),
    with Qwen3's q/k norms, for mixtures of experts in float32, int8 and w8a8 (the same
    pairs counted per expert), and in bfloat16 (steps of at most 16 rows: bf16_linear in
    both). A 40-token prompt's later chunks of 16 give experts several rows in one step
    (w8a8's tile unit, where the CPU has one, from 4). Weight-only int8 and int4 run on
    int8 dot products (``int8_sliced_linear``, ``int4_sliced_linear``) where the CPU has
    them, and "widened" forces the kernels of CPUs without them (``int8_linear``,
    ``int4_linear``)."""
    widened = quantization.endswith(" widened")
    if widened:
        monkeypatch.setattr(quantized_linear, "slices_on_dot_products", lambda: False)
        quantization = quantization.removesuffix(" widened")
    overrides = [*BASE, f"model.dtype={dtype}", "scheduler=chunked", "scheduler.token_budget=16"]
    quantization, _, head = quantization.partition("+")
    overrides += [] if quantization == "none" else [f"model.quantization={quantization}"]
    if head:  # the int8 (head) or int4 (head4) LM head, in the stack's call too
        overrides.append(f"model.quantization_lm_head={'int4' if head == 'head4' else 'true'}")
    if quantization in ("int4", "w4a8"):
        overrides.append("model.quantization_group_size=32")
    llm = LLM(checkpoints[family], overrides=overrides)
    try:
        prompts = mixed_prompts(llm.engine.vocab_size, lengths=(5, 40))
        stack = counted(llm)
        model = llm.engine.executor.worker.model
        before = routed_pairs(model)
        with_stack = sampled(llm, prompts)
        between = routed_pairs(model)
        assert stack.served > 0 and stack.with_head > 0  # decode steps ran the LM head in the call
        kinds = set(model._native_stack.kinds) | {model._native_stack.head_kind}
        sliced = not widened and w8a8_unavailable_reason() is None
        if quantization.startswith(("int8", "int4")):
            kind, sliced_kind = (INT8, INT8_SLICED) if quantization.startswith("int8") else (INT4, INT4_SLICED)
            assert (sliced_kind in kinds, kind in kinds) == (sliced, not sliced)
        model._native_stack = None
        assert sampled(llm, prompts) == with_stack
        after = routed_pairs(model)
        for layer in before:  # the expert load each way
            assert [b - a for a, b in zip(before[layer], between[layer])] == [
                b - a for a, b in zip(between[layer], after[layer])], layer
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family, overrides", [
    ("qwen2-moe", ["model.dtype=float32"]),  # gated shared experts
    ("deepseek-v3", ["model.dtype=float32"]),  # latent attention, grouped sigmoid routing
    ("llama", ["model.dtype=float32", "attention=sdpa"]),
    ("llama", ["model.dtype=bfloat16", "model.quantization=int8"]),  # quantized kernels take float32 rows
])
def test_models_the_stack_does_not_serve_take_the_loop(checkpoints, family, overrides):
    llm = LLM(checkpoints[family], overrides=[*BASE, *overrides])
    try:
        assert NativeDecodeStack.of(llm.engine.executor.worker.model) is None
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family, overrides", [
    ("llama", ["model.dtype=float32"]), ("qwen3", ["model.dtype=float32"]), ("qwen3-moe", ["model.dtype=float32"]),
    ("qwen2", ["model.dtype=bfloat16"]),
    pytest.param("llama", ["model.dtype=float32", "model.quantization=w8a8", "model.quantization_lm_head=true"],
                 marks=W8A8)])
def test_greedy_steps_in_one_call_equal_single_steps(checkpoints, family, overrides):
    """Multi-step decoding's greedy steps in the stack's one call (each row's argmax fed
    back natively, its slots read from its block table across block boundaries) give the
    tokens of one step at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    single = LLM(checkpoints[family], overrides=[*BASE, *overrides])
    try:
        prompts = mixed_prompts(single.engine.vocab_size, lengths=(5, 14, 3))
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    finally:
        single.shutdown()
    llm = LLM(checkpoints[family], overrides=[*BASE, *overrides, "decoding.multi_step=5"])
    try:
        stack = llm.engine.executor.worker.model.native_stack()
        runs = []
        original = stack.greedy_steps
        stack.greedy_steps = lambda *args: runs.append(args[-1]) or original(*args)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert runs and max(runs) == 5 and stack.head_weights
        assert got == expected
    finally:
        llm.shutdown()
