"""Quantized KV caches (``cache.kv_dtype`` int8 / fp8_e4m3) end to end: logprobs near the
float cache's and equal across backends, block copies / swapping / prefix caching intact
with no leaked blocks, sizing from memory, and the start-up errors."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.core.errors import ConfigError
from servelab.kernels.cpu_ops import native_cpu_unavailable_reason
from servelab.testing import mixed_prompts

# Chunks of 16 tokens in blocks of 4: most positions attend over cached context.
BASE = ["model.dtype=float32", "device=cpu", "scheduler=chunked", "scheduler.token_budget=16", "cache.block_size=4"]
KV_DTYPES = ["int8"] + (["fp8_e4m3"] if hasattr(torch, "float8_e4m3fn") else [])
BACKENDS = ["naive", "sdpa", "cpu", "flash"]
# Largest change of a prompt token's logprob against the float cache (tiny random Llama,
# whose logprobs are about -5.5): int8 keeps about 8 bits of each key and value, fp8 4.
FLOAT_TOLERANCE = {"int8": 0.01, "fp8_e4m3": 0.08}
BACKEND_TOLERANCE = 1e-4
"""Every backend reads the same dequantized values: only float32 summation order differs."""


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """The logprob of every prompt token after the first, all prompts concatenated."""
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return torch.tensor([entry[token].logprob for prompt, output in zip(prompts, outputs)
                         for token, entry in zip(prompt[1:], output.prompt_logprobs[1:])])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three prompts of 21-45 tokens."""
    return mixed_prompts(257, lengths=(45, 21, 33), seed=3)


@pytest.fixture(scope="module")
def reference(llama, prompts) -> dict[str, torch.Tensor]:
    """Logprobs of the float cache and of each quantized cache, on the naive backend."""
    return {kv: prompt_logprobs(LLM(llama, overrides=[*BASE, "attention=naive", f"cache.kv_dtype={kv}"]), prompts)
            for kv in ["auto", *KV_DTYPES]}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("attention", BACKENDS)
def test_logprobs_near_the_float_cache_and_equal_across_backends(llama, prompts, reference, attention_env,
                                                                  attention, kv_dtype):
    """Each backend dequantizes the values the reference reads, and they stay near float's."""
    attention_env(attention)
    if attention == "cpu" and native_cpu_unavailable_reason() is not None:
        pytest.skip(f"native CPU ops: {native_cpu_unavailable_reason()}")
    llm = LLM(llama, overrides=[*BASE, f"attention={attention}", f"cache.kv_dtype={kv_dtype}"])
    assert llm.engine.executor.kv_caches[0].dtype == (torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn)
    logprobs = prompt_logprobs(llm, prompts)
    assert (logprobs - reference[kv_dtype]).abs().max() < BACKEND_TOLERANCE
    change = (logprobs - reference["auto"]).abs().max()
    assert 0 < change < FLOAT_TOLERANCE[kv_dtype]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_swap_copy_on_write_and_prefix_cache_keep_working(llama, kv_dtype):
    """Under pressure (swapping, prefix-cache evictions, speculative rollbacks, n=2 sharing
    a prompt block copy-on-write) the quantized cache gives what it gives without pressure,
    and every device and host block comes back."""
    pressure = ["cache.num_blocks=40", "cache.swap_space_bytes=1000000", "scheduler.preemption=swap",
                "cache.enable_prefix_caching=true", "decoding=ngram", "model.max_model_len=128",
                "scheduler=continuous"]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = mixed_prompts(257, lengths=(40, 33, 25, 47, 38), seed=7)
    repeat = [p[:24] + [3, 4] for p in prompts]  # afterwards: prefix-cache hits on the blocks not evicted
    common = ["model.dtype=float32", "device=cpu", "cache.block_size=4", f"cache.kv_dtype={kv_dtype}"]
    llm = LLM(llama, overrides=[*common, *pressure])
    steps = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    got = [[c.token_ids for c in o.outputs] for batch in (prompts, repeat)
           for o in llm.generate(batch, params, use_tqdm=False)]
    alone = LLM(llama, overrides=common)
    expected = [[c.token_ids for c in o.outputs] for o in alone.generate(prompts + repeat, params, use_tqdm=False)]
    assert got == expected
    assert any(o.blocks_to_swap_out for o in steps) and any(o.blocks_to_copy for o in steps)
    cache = llm.engine.cache
    assert cache.prefix_hit_tokens > 0
    assert cache.usage.used_blocks == 0 and cache.num_free_blocks == 40
    assert cache.host_pool.num_free == cache.num_host_blocks > 0


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_memory_sizing_counts_the_smaller_blocks(llama, cache):
    """The same ``memory_bytes`` holds (D * 4) / (D + 4) times the float32 blocks at int8
    (the scales included), and the executor's tensors take exactly those bytes."""
    memory = 1 << 20
    size = ["cache.block_size=16"] if cache == "contiguous" else []
    engines = {kv: LLM(llama, overrides=["model.dtype=float32", "device=cpu", f"cache={cache}", *size,
                                         f"cache.memory_bytes={memory}", f"cache.kv_dtype={kv}"]).engine
               for kv in ("auto", "int8")}
    spec = engines["auto"].cache.spec
    head_dim, layers, heads, block = spec.head_dim, spec.num_layers, spec.num_kv_heads, 16
    assert engines["auto"].cache.num_blocks == memory // (2 * layers * heads * head_dim * 4 * block)
    assert engines["int8"].cache.num_blocks == memory // (2 * layers * heads * (head_dim + 4) * block)
    assert engines["int8"].cache.num_blocks >= 2 * engines["auto"].cache.num_blocks
    for engine in engines.values():
        stored = sum(t.numel() * t.element_size() for t in engine.executor.kv_caches)
        assert stored == engine.cache.num_blocks * engine.cache.spec.bytes_per_token * block <= memory


def test_bad_kv_dtype_fails_at_start_up_naming_the_field(llama, monkeypatch):
    with pytest.raises(ConfigError, match=r"cache.kv_dtype must be one of auto, int8, fp8_e4m3, got 'int4'"):
        LLM(llama, overrides=["device=cpu", "cache.kv_dtype=int4"])
    monkeypatch.delattr(torch, "float8_e4m3fn", raising=False)
    with pytest.raises(ConfigError, match=r"cache.kv_dtype=fp8_e4m3 needs torch.float8_e4m3fn"):
        LLM(llama, overrides=["device=cpu", "cache.kv_dtype=fp8_e4m3"])


def test_backend_without_a_quantized_path_is_refused(llama, monkeypatch):
    from servelab.plugins.attention.naive import NaiveAttention

    monkeypatch.setattr(NaiveAttention, "reads_quantized_kv", False)
    with pytest.raises(ConfigError, match=r"cache.kv_dtype=int8: attention=naive does not read a quantized KV cache"):
        LLM(llama, overrides=["device=cpu", "attention=naive", "cache.kv_dtype=int8"])
