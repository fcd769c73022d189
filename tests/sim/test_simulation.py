"""executor=simulated: the engine's own scheduler and cache on a virtual clock, deterministic,
with the same block accounting as the real executor, and clear errors for what cannot run."""

from __future__ import annotations

import pytest

from servelab import ConfigError, LLM, SamplingParams
from servelab.core.entrypoints.compose import compose_config
from servelab.core.cost_model import BatchShape
from servelab.core.engine.llm_engine import LLMEngine
from servelab.testing import mixed_prompts

SIMULATED = ["executor=simulated", "cost_model=roofline"]
LLAMA_7B = ["model=llama-2-7b", "hardware=a100-80gb", *SIMULATED]


def bench(tmp_path, *overrides: str) -> dict:
    """``servelab-bench`` in this process (Hydra app) with ``overrides``; its metrics."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "from servelab.bench.cli import main; main()", "use_tqdm=false",
                             f"hydra.run.dir={tmp_path}", *overrides], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp_path / "metrics.json").read_text())


def test_virtual_time_runs_are_deterministic(tmp_path):
    args = [*LLAMA_7B, "workload=sharegpt", "workload.num_requests=64", "workload.rate=8"]
    first, second = bench(tmp_path / "a", *args), bench(tmp_path / "b", *args)
    assert first["simulated"] is True and first["num_completed"] == 64
    for key in ("duration_s", "ttft_ms", "tpot_ms", "itl_ms", "output_throughput", "preemptions"):
        assert first[key] == second[key], key
    assert first["simulated_seconds_per_wall_second"] == pytest.approx(first["duration_s"] / first["wall_time_s"])


def schedule_trace(overrides: list[str], prompts: list[list[int]]) -> list[tuple]:
    """Every step's grants (request, computed, new, blocks), preemptions and prefix hits,
    all requests added before the first step."""
    llm = LLM("toy", overrides=overrides)
    engine = llm.engine
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        output = schedule()
        steps.append((tuple((g.request.request_id, g.num_computed_tokens, g.num_new_tokens, g.block_ids)
                            for g in output.scheduled), output.preempted, output.num_prefix_hit_tokens,
                      output.blocks_to_copy))
        return output

    engine.scheduler.schedule = recording
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_block_accounting_equals_the_real_executor(scheduler):
    """Same admissions, chunks, preemptions, prefix hits and block tables step by step."""
    shared = mixed_prompts(257, lengths=(24,), seed=7)[0]
    prompts = [shared + p for p in mixed_prompts(257, lengths=(5, 30, 12, 40, 3, 22, 17, 35), seed=1)]
    base = ["model.dtype=float32", "device=cpu", f"scheduler={scheduler}", "cache.block_size=4", "cache.num_blocks=40",
            "cache.enable_prefix_caching=true", "model.max_model_len=128"]
    if scheduler == "chunked":
        base.append("scheduler.token_budget=32")
    real = schedule_trace(base, prompts)
    simulated = schedule_trace([*base, *SIMULATED], prompts)
    assert real == simulated
    assert any(preempted for _, preempted, _, _ in real) and any(hits for _, _, hits, _ in real)


def test_simulation_keeps_virtual_time_and_reports_steps():
    llm = LLM(overrides=[*LLAMA_7B])
    engine = llm.engine
    assert engine.clock.is_virtual and engine.clock.now() == 0.0
    (output,) = llm.generate([[1] * 100], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    metrics = output.metrics
    assert len(output.outputs[0].token_ids) == 50
    assert 0 < metrics.ttft < 1 and 0 < metrics.tpot < 0.1   # a 7B model on an A100
    assert engine.clock.now() == pytest.approx(metrics.token_times[-1])


def test_simulated_speculation_keeps_drafts_at_the_configured_rate():
    llm = LLM(overrides=[*LLAMA_7B, "decoding=ngram", "decoding.num_speculative_tokens=4",
                         "decoding.simulated_acceptance_rate=0.6"])
    outputs = llm.generate([[1] * 50] * 32, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    proposed = sum(o.metrics.spec_proposed_tokens for o in outputs)
    accepted = sum(o.metrics.spec_accepted_tokens for o in outputs)
    # each draft kept with probability 0.6 until the first rejection:
    # E[kept of 4] / 4 = (0.6 + 0.6**2 + 0.6**3 + 0.6**4) / 4 = 0.3264
    assert accepted / proposed == pytest.approx(0.3264, abs=0.03)
    assert all(len(o.outputs[0].token_ids) == 200 for o in outputs)


@pytest.mark.parametrize("overrides, message", [
    (["model=llama-2-70b", "hardware=a100-40gb"], "does not fit hardware=a100-40gb"),
    (["model=llama-2-7b", "hardware=a100-80gb", "parallel.tensor_parallel_size=3"],
     "tensor_parallel_size=3 does not divide the model's 32 attention heads"),
    (["model=falcon-180b", "hardware=a100-80gb", "parallel.pipeline_parallel_size=100"],
     "pipeline_parallel_size=100 exceeds the model's 80 layers"),
])
def test_configurations_that_cannot_run_name_the_reason(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine(compose_config([*overrides, *SIMULATED]))


def test_quantized_weights_leave_more_kv_memory_and_decode_faster():
    engines = {mode: LLMEngine(compose_config([*LLAMA_7B, f"model.quantization={mode}"]))
               for mode in ("none", "int8", "int4")}
    blocks = {mode: engine.cache.num_blocks for mode, engine in engines.items()}
    # 80 GiB x 0.9 less 2 GiB of activations: 57.4 GiB of KV cache beside 12.6 GiB of float16
    # weights, 63.5 GiB beside 6.5 GiB of int8 weights
    assert 1.09 < blocks["int8"] / blocks["none"] < 1.12
    assert blocks["int4"] > blocks["int8"]
    decode = BatchShape((1,), (128,), 1)
    seconds = {mode: engine.executor.cost_model.forward_cost(decode).total for mode, engine in engines.items()}
    assert seconds["int4"] < seconds["int8"] < 0.65 * seconds["none"]


def test_a_one_byte_kv_cache_holds_twice_the_blocks_and_reads_half_the_bytes():
    engines = {kv: LLMEngine(compose_config([*LLAMA_7B, f"cache.kv_dtype={kv}"])) for kv in ("auto", "int8")}
    # float16 keys and values (256 bytes per head and token) against 128 int8 bytes and a 4-byte scale
    assert engines["int8"].cache.num_blocks / engines["auto"].cache.num_blocks == pytest.approx(256 / 132, rel=0.01)
    long_decodes = BatchShape((1,) * 64, (2048,) * 64, 64)
    seconds = {kv: engine.executor.cost_model.forward_cost(long_decodes).total for kv, engine in engines.items()}
    assert seconds["int8"] < 0.7 * seconds["auto"], "64 decodes over 2,048 tokens read mostly KV cache"


def test_the_model_executor_refuses_a_shape_without_weights():
    with pytest.raises(ConfigError, match="has no weights: executor=model runs checkpoints"):
        LLMEngine(compose_config(["model=llama-2-7b"]))


def test_every_shape_preset_simulates():
    for preset, hardware, tp in [("llama-2-7b", "a100-80gb", 1), ("llama-2-70b", "a100-80gb", 4),
                                 ("llama-3-8b", "h100-80gb", 1), ("llama-3-70b", "h100-80gb", 4),
                                 ("mistral-7b", "a100-80gb", 1), ("yi-34b", "a100-80gb", 2),
                                 ("qwen2.5-7b", "l40s", 1), ("opt-13b", "a100-80gb", 1),
                                 ("gpt-3-175b", "a100-80gb", 8), ("falcon-180b", "h200", 4),
                                 ("gemma-3-27b", "h100-80gb", 2), ("deepseek-v2-lite", "a100-80gb", 1)]:
        llm = LLM(overrides=[f"model={preset}", f"hardware={hardware}", f"parallel.tensor_parallel_size={tp}",
                             *SIMULATED])
        (output,) = llm.generate([[1] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 4, preset
        assert llm.engine.cache.num_blocks > 1000, (preset, llm.engine.cache.num_blocks)


def test_gemma_3_27b_decodes_faster_with_its_windowed_layers_priced(tmp_path):
    args = ["model=gemma-3-27b", "hardware=a100-80gb", "model.max_model_len=8192", *SIMULATED, "workload=offline",
            "workload.num_requests=4", "workload.input_range=[4096,4096]", "workload.output_range=[8,8]"]
    windowed = bench(tmp_path / "windowed", *args)
    global_only = bench(tmp_path / "global", *args, "model.shape.window_pattern=[]", "model.shape.sliding_window=null")
    assert windowed["num_completed"] == global_only["num_completed"] == 4
    assert windowed["tpot_ms"]["mean"] < global_only["tpot_ms"]["mean"]


def test_latent_attention_caches_and_reads_less_than_multi_head_attention():
    import torch

    # a Llama shape of the same sizes: its implementation has no experts, so it is read from the sizes
    mha = ["model.shape.architecture=LlamaForCausalLM", "model.shape.latent=null", "model.shape.head_dim=160"]
    engines = {variant: LLMEngine(compose_config(["model=deepseek-v2-lite", "hardware=a100-80gb", *SIMULATED,
                                                  *overrides]))
               for variant, overrides in (("mla", []), ("mha", mha))}
    assert engines["mla"].executor.context.model_cls.__name__ == "DeepseekV2ForCausalLM"
    # 576 latent elements per token and layer, stored once, against the decompressed K
    # and V of 16 heads (192 + 128 = 2 x 160)
    stored = {v: engine.shape.kv_cache_spec(torch.bfloat16, 8192).bytes_per_token for v, engine in engines.items()}
    assert stored == {"mla": 27 * 576 * 2, "mha": 27 * 2 * 16 * 160 * 2}
    long_decodes = BatchShape((1,) * 32, (4096,) * 32, 32)
    costs = {v: engine.executor.cost_model.forward_cost(long_decodes) for v, engine in engines.items()}
    attention = {v: dict(cost.breakdown)["attn_decode"] for v, cost in costs.items()}
    assert attention["mla"] < 0.2 * attention["mha"]
    assert costs["mla"].total < 0.6 * costs["mha"].total  # the same experts in both


def test_pipeline_stages_overlap_steps_and_report_bubbles(tmp_path):
    metrics = bench(tmp_path, "model=llama-2-70b", "hardware=a100-80gb", "parallel.tensor_parallel_size=4",
                    "parallel.pipeline_parallel_size=2", *SIMULATED, "workload=sharegpt",
                    "workload.num_requests=64", "workload.rate=4")
    stages = metrics["system"]["stage_busy_s"]
    assert len(stages) == 2 and all(busy > 0 for busy in stages)
    assert all(0 <= f < 1 for f in metrics["system"]["stage_bubble_fraction"])
    assert metrics["num_completed"] == 64


def test_replicas_behind_a_prefix_affinity_router_share_prefixes(tmp_path):
    common = [*LLAMA_7B, "workload=shared_prefix", "workload.num_requests=48", "workload.arrival=poisson",
              "workload.rate=16", "cache.enable_prefix_caching=true", "target.replicas=3"]
    affinity = bench(tmp_path / "affinity", *common, "router=prefix_affinity")
    spread = bench(tmp_path / "spread", *common, "router=round_robin")
    assert affinity["num_completed"] == spread["num_completed"] == 48
    assert sum(r["routed"] for r in affinity["system"]["replicas"]) == 48
    assert affinity["prefix_cache_hit_rate"] > spread["prefix_cache_hit_rate"]


def test_kv_aware_router_follows_the_cache_events(tmp_path):
    common = [*LLAMA_7B, "workload=shared_prefix", "workload.num_requests=48", "workload.arrival=poisson",
              "workload.rate=16", "cache.enable_prefix_caching=true", "target.replicas=3"]
    aware = bench(tmp_path / "aware", *common, "router=kv_aware")
    spread = bench(tmp_path / "spread", *common, "router=round_robin")
    assert aware["num_completed"] == 48
    assert aware["prefix_cache_hit_rate"] > spread["prefix_cache_hit_rate"]
    assert min(r["routed"] for r in aware["system"]["replicas"]) > 0  # load still spreads requests


def test_replicas_need_simulation():
    from servelab.bench.config import store_bench_schemas
    from servelab.bench.runner import open_system

    store_bench_schemas()
    cfg = compose_config(["model=toy", "target.replicas=2"], config_name="bench")
    with pytest.raises(ConfigError, match="runs under executor=simulated"):
        open_system(cfg, "/tmp")
