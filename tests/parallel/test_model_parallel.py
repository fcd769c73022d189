"""executor=model over several processes (gloo on the CPU): greedy output equal to
transformers (hence to one device), clear errors for splits that cannot work, and a
worker that dies failing the engine at once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from servelab import ConfigError, LLM, SamplingParams
from servelab.testing import assert_engine_matches_transformers, mixed_prompts, tiny_checkpoint

BASE = ["model.dtype=float32", "device=cpu"]
PAGED = "cache.block_size=4"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints: Llama (2 KV heads), Qwen2 (tied embeddings, q/k/v biases), and a
    Llama with one KV head (replicated across two ranks)."""
    root = tmp_path_factory.mktemp("parallel")
    return {"llama": tiny_checkpoint(root / "llama", "llama"), "qwen2": tiny_checkpoint(root / "qwen2", "qwen2"),
            "mqa": tiny_checkpoint(root / "mqa", "llama", num_key_value_heads=1),
            "draft": tiny_checkpoint(root / "draft", "llama", seed=5)}


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints of the families beyond Llama and their layouts."""
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_checkpoint(root / family, family) for family in FAMILY_SPLITS}


FAMILY_SPLITS = ("phi3", "opt-project", "falcon", "falcon-new", "gemma2", "gemma3", "deepseek-v2-qlora", "mixtral",
                 "qwen2-moe", "qwen3-moe", "deepseek-v3")
"""Families (and layouts) checked at tp=2, each splitting its own modules."""
STAGE_SPLITS = ("phi3", "opt-project", "falcon", "gemma3", "deepseek-v2-qlora", "qwen2-moe")
"""One layout per family (the rest share its stage code) checked at pp=2: stage-local
weights, tied heads, what a stage carries, Qwen2-MoE's dense layer 0 on the first stage."""
SPLITS = [(family, "parallel.tensor_parallel_size=2") for family in FAMILY_SPLITS] + [
    (family, "parallel.pipeline_parallel_size=2") for family in STAGE_SPLITS]


def matches(folder: str, *overrides: str, prompts=None) -> None:
    """Greedy tokens equal transformers' through an engine with ``overrides``; the engine
    (and its workers) shut down afterwards."""
    llm = LLM(folder, overrides=[*BASE, *overrides])
    try:
        assert_engine_matches_transformers(folder, prompts=prompts, llm=llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("model, overrides", [
    ("llama", ["parallel.tensor_parallel_size=2", PAGED]),
    ("qwen2", ["parallel.tensor_parallel_size=2", PAGED, "scheduler=chunked", "scheduler.token_budget=16"]),
    ("mqa", ["parallel.tensor_parallel_size=2", PAGED]),
    ("llama", ["parallel.pipeline_parallel_size=2", PAGED, "scheduler=chunked", "scheduler.token_budget=16"]),
    ("llama", ["parallel.tensor_parallel_size=2", "scheduler=static", "cache=contiguous"]),
    ("llama", ["parallel.tensor_parallel_size=2", PAGED, "decoding=ngram", "cache.num_blocks=40", "model.max_model_len=128",
               "cache.swap_space_bytes=1000000", "scheduler.preemption=swap", "cache.enable_prefix_caching=true"]),
    ("llama", ["parallel.tensor_parallel_size=2", PAGED, "decoding.multi_step=4"]),
], ids=["tp2", "tp2-tied-bias-chunked", "tp2-replicated-kv", "pp2-chunked", "tp2-static-contiguous",
        "tp2-ngram-swap-prefix", "tp2-multi-step"])
def test_greedy_output_equals_one_device(models, model, overrides):
    matches(models[model], *overrides)


@pytest.mark.parametrize("family, split", SPLITS,
                         ids=[f"{'tp2' if 'tensor' in split else 'pp2'}-{family}" for family, split in SPLITS])
def test_families_split_like_one_device(families, family, split):
    """Each family's fused, replicated and stage-local weights land where one device has them
    (Phi-3's fused projections, OPT's positions, project_in/out and tied head, Falcon's
    query_key_value in the multi-query and grouped layouts, Gemma's replicated norms and
    q/k norms beside windowed and global layers, DeepSeek-V2's query heads split (q_b_proj,
    kv_b_proj; q_proj splits alike) and its latent projection, norms and cached latent
    head whole on every rank, the mixtures of experts' expert columns split beside whole
    routers and shared-expert gates, DeepSeek-V3's latent attention beside its experts,
Qwen2-MoE's dense layer 0 on the first stage)."""
    matches(families[family], split, PAGED, "scheduler=chunked", "scheduler.token_budget=16")


@pytest.mark.parametrize("family, dispatch, stages", [
    ("mixtral", "all_reduce", 1), ("qwen2-moe", "all_reduce", 1), ("deepseek-v3", "all_reduce", 1),
    ("mixtral", "all_to_all", 1), ("qwen2-moe", "all_to_all", 1), ("deepseek-v3", "all_to_all", 1),
    ("mixtral", "all_to_all", 2)])
def test_expert_parallelism_equals_one_device(families, family, dispatch, stages):
    """Each tensor-parallel rank holds half the routed experts whole (Qwen2-MoE's and
    DeepSeek-V3's shared experts and dense layer split as ever, V3's grouped router and its
    correction bias whole on every rank); with ``all_to_all`` each rank routes half the
    tokens and their pairs travel to their experts' ranks and back (a decode step's one
    token leaves the second rank none); the expert load is reported per rank, all pairs
    counted either way; under two pipeline stages each stage's pair of ranks splits its
    layers' experts."""
    llm = LLM(families[family], overrides=[*BASE, "parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2",
                                           f"parallel.pipeline_parallel_size={stages}",
                                           f"parallel.expert_dispatch={dispatch}", PAGED, "scheduler=chunked",
                                           "scheduler.token_budget=16"])
    try:
        assert_engine_matches_transformers(families[family], llm=llm)
        load = llm.engine.executor.expert_load()
        assert load.ranks == 2 and len(load.per_rank()) == 2
        assert sum(load.per_rank()) == sum(load.per_expert()) > 0
    finally:
        llm.engine.shutdown()


def test_tensor_and_pipeline_together_with_a_draft_model(models):
    matches(models["qwen2"], "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2")
    matches(models["llama"], "parallel.tensor_parallel_size=2", "decoding=speculative",
            f"decoding.draft_path={models['draft']}")


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor_parallel_size=3"], "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
    (["parallel.tensor_parallel_size=4"], "neither divides the other"),
    (["parallel.pipeline_parallel_size=3"], "pipeline_parallel_size=3 exceeds the model's 2 layers"),
    (["parallel.tensor_parallel_size=2", "parallel.init_method=ssh"], "parallel.init_method must be one of"),
    (["parallel.tensor_parallel_size=2", "model.max_model_len=100000"], "exceeds the model's max_position"),
    (["parallel.threads=0"], "parallel.threads must be at least 1 .*got 0"),
])
def test_splits_that_cannot_work_name_the_numbers(models, overrides, message):
    folder = models["mqa"] if "tensor_parallel_size=4" in overrides[0] else models["llama"]
    if "tensor_parallel_size=4" in overrides[0]:
        folder = tiny_checkpoint(os.path.join(os.path.dirname(folder), "kv3"), "llama", num_attention_heads=12,
                                 num_key_value_heads=3, hidden_size=96)
    with pytest.raises(ConfigError, match=message):
        LLM(folder, overrides=[*BASE, *overrides])
    assert not dist.is_initialized(), "a refused engine left its process group (and workers) behind"


@pytest.mark.parametrize("family, fields, overrides, message", [
    ("opt", {}, ["parallel.tensor_parallel_size=3"], "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
    ("falcon-new", {"ffn_hidden_size": 130}, ["parallel.tensor_parallel_size=4"],
     "tensor_parallel_size=4 does not divide the MLP's intermediate size 130"),
    ("qwen3-moe", {"moe_intermediate_size": 33}, ["parallel.tensor_parallel_size=2"],
     "tensor_parallel_size=2 does not divide the routed experts' intermediate size 33"),
])
def test_family_splits_that_cannot_work_name_the_numbers(tmp_path, family, fields, overrides, message):
    folder = tiny_checkpoint(tmp_path / family, family, **fields)
    with pytest.raises(ConfigError, match=message):
        LLM(folder, overrides=[*BASE, *overrides])
    assert not dist.is_initialized()


def test_threads_set_an_engine_on_one_device_and_come_back_on_release(models):
    before = torch.get_num_threads()
    threads = 1 if before > 1 else 2
    llm = LLM(models["llama"], overrides=[*BASE, f"parallel.threads={threads}"])
    assert torch.get_num_threads() == threads
    outputs = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    llm.shutdown()
    assert torch.get_num_threads() == before


def test_a_dead_worker_fails_the_engine_at_once(models):
    llm = LLM(models["llama"], overrides=[*BASE, "parallel.tensor_parallel_size=2"])
    engine = llm.engine
    (worker,) = engine.executor.workers
    engine.add_request(mixed_prompts(257, (20,))[0], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a parallel worker exited: rank 1 \(pid \d+, exit code -9\)"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - started < 10
    engine.shutdown()
    assert not worker.is_alive()
