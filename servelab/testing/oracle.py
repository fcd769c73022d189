"""The oracle: tiny random checkpoints and Hugging Face transformers' greedy ``generate``
in float32, token for token."""

from __future__ import annotations

import os
import random
from typing import Any, Sequence

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "opt", "opt-postnorm", "opt-project",
            "falcon", "falcon-new", "gemma2", "gemma3", "deepseek-v2", "deepseek-v2-qlora", "mixtral", "qwen2-moe",
            "qwen3-moe", "deepseek-v2-moe", "deepseek-v3")
"""Tiny configs: the Llama family; Phi-3 (longrope, partial rotary); OPT pre-norm, post-norm
(350m-style) and with project_in/out (``word_embed_proj_dim`` != hidden); Falcon 7B-style
(multi-query, one norm, parallel attention and MLP) and ``new_decoder_architecture``
(grouped KV heads, ln_attn and ln_mlp); Gemma 2 (a sliding layer of window 16 then a
global one, soft-capped attention scores and logits, ``query_pre_attn_scalar`` != head_dim)
and Gemma 3 (sliding, global, sliding with window 8; q/k norms, local and global rope
bases); DeepSeek-V2 with dense layers and latent attention, queries straight from the
hidden state (a latent of 24 and a rotary key of 8: cached heads of 32) or through a
``q_lora_rank`` of 24 (a latent of 16: heads of 24, which attention=cpu takes only where
the SIMD width divides them). The Gemma and DeepSeek configs draw weights 5x wider than
the default (Gemma's untie the LM head), so that attention (and its cap) decides the
greedy tokens instead of the embedding. Mixtures of experts, top-2 with weights 5x wider
than the default (so the routed experts decide tokens): Mixtral (4 experts of 32,
renormalised), Qwen2-MoE (8 experts of 32, not renormalised, a gated shared expert of 48,
layer 0 dense through ``mlp_only_layers``), Qwen3-MoE (6 experts of 32, ``norm_topk_prob``,
q/k norms); DeepSeek-V2 with a dense first layer then 8 experts of 32 in 4 groups, top-2
within the best 2 groups (``group_limited_greedy``), one shared expert, weights scaled by
1.5; DeepSeek-V3 likewise with sigmoid scores, a random ``e_score_correction_bias``,
groups scored by their two best experts, renormalised and scaled by 2.5, a latent of 24
and queries through a ``q_lora_rank`` of 24."""
ZERO_CENTRED_NORMS = ("gemma2", "gemma3")
"""Families whose norms scale by 1 + weight and start at zero: their tiny checkpoints draw
the norm weights at random, so that the offset is exercised."""
ZERO_STARTED = ("e_score_correction_bias",)
"""Parameters transformers starts at zero that tiny checkpoints draw at random (DeepSeek-V3's
routing bias), so that they change the output."""


def tiny_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    """A small random-model config of ``family`` (see ``FAMILIES``)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    ids = dict(vocab_size=vocab_size, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=None)
    opt = dict(ids, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, word_embed_proj_dim=64)
    falcon = dict(ids, hidden_size=64, ffn_hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, alibi=False, bias=False)
    longrope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.5, 2.0, 3.0, 4.0]}
    gemma = dict(common, pad_token_id=None, head_dim=16, query_pre_attn_scalar=24, initializer_range=0.1,
                 tie_word_embeddings=False)
    deepseek = dict(common, pad_token_id=None, num_key_value_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8, first_k_dense_replace=3, initializer_range=0.1)
    moe = dict(common, pad_token_id=None, num_experts_per_tok=2, initializer_range=0.1)
    deepseek_moe = dict(deepseek, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                        moe_intermediate_size=32, num_experts_per_tok=2, n_group=4, topk_group=2)
    qwen_moe = dict(moe, moe_intermediate_size=32)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "llama3": lambda: transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=500000.0),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "phi3": lambda: transformers.Phi3Config(**dict(common, pad_token_id=None), partial_rotary_factor=0.5,
                                                original_max_position_embeddings=64, rope_scaling=longrope),
        "opt": lambda: transformers.OPTConfig(**opt),
        "opt-postnorm": lambda: transformers.OPTConfig(**opt, do_layer_norm_before=False),
        "opt-project": lambda: transformers.OPTConfig(**dict(opt, word_embed_proj_dim=32)),
        "falcon": lambda: transformers.FalconConfig(**falcon, multi_query=True, parallel_attn=True,
                                                    new_decoder_architecture=False),
        "falcon-new": lambda: transformers.FalconConfig(**falcon, num_kv_heads=2, new_decoder_architecture=True),
        "gemma2": lambda: transformers.Gemma2Config(**gemma, sliding_window=16, attn_logit_softcapping=0.5,
                                                    final_logit_softcapping=1.0),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **dict(gemma, num_hidden_layers=3), sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "deepseek-v2": lambda: transformers.DeepseekV2Config(**deepseek, kv_lora_rank=24, q_lora_rank=None),
        "deepseek-v2-qlora": lambda: transformers.DeepseekV2Config(**dict(deepseek, num_hidden_layers=3),
                                                                   kv_lora_rank=16, q_lora_rank=24),
        "mixtral": lambda: transformers.MixtralConfig(**dict(moe, intermediate_size=32), num_local_experts=4),
        "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**qwen_moe, num_experts=8, shared_expert_intermediate_size=48,
                                                         mlp_only_layers=[0]),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**qwen_moe, head_dim=32, num_experts=6, norm_topk_prob=True),
        "deepseek-v2-moe": lambda: transformers.DeepseekV2Config(
            **deepseek_moe, kv_lora_rank=24, q_lora_rank=None, topk_method="group_limited_greedy",
            routed_scaling_factor=1.5),
        "deepseek-v3": lambda: transformers.DeepseekV3Config(**deepseek_moe, kv_lora_rank=24, q_lora_rank=24,
                                                             routed_scaling_factor=2.5, norm_topk_prob=True),
    }
    if family not in configs:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    config = configs[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_checkpoint(folder: str | os.PathLike, family: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Write a random float32 ``family`` model and servelab's byte-level tokenizer to
    ``folder`` with ``save_pretrained``; returns the folder. ``overrides`` set config
    fields (``vocab_size=8`` makes a model that only uses the first 8 byte tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from servelab.checkpoints.toy import byte_level_tokenizer

    folder = str(folder)
    tokenizer = byte_level_tokenizer()
    config = tiny_config(family, overrides.pop("vocab_size", len(tokenizer)), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ZERO_STARTED) or (family in ZERO_CENTRED_NORMS and name.endswith("norm.weight")):
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith(ZERO_STARTED):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def mixed_prompts(vocab_size: int, lengths: Sequence[int] = (3, 17, 40, 9, 64), seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size - 1) for _ in range(n)] for n in lengths]


def hot_prefix_prompts(rounds: int = 4, seed: int = 0) -> list[list[int]]:
    """Prompts that reuse context between bursts that flush a small cache: per round,
    twice a hot 32-token prefix with 4 tokens of its own, then three one-off 60-token
    prompts (tokens in [3, 200)). On a 40-block cache of 4-token blocks, run one at a
    time, the one-off prompts evict the hot prefix unless a cache keeps it."""
    rng = random.Random(seed)
    hot = [rng.randrange(3, 200) for _ in range(32)]
    prompts = []
    for _ in range(rounds):
        prompts += [hot + [rng.randrange(3, 200) for _ in range(4)] for _ in range(2)]
        prompts += [[rng.randrange(3, 200) for _ in range(60)] for _ in range(3)]
    return prompts


def transformers_greedy(folder: str, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Generated token ids of transformers' greedy ``generate`` in float32, per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
            results.append(out[0, len(prompt):].tolist())
    return results


_reference_cache: dict[tuple, list[list[int]]] = {}


def assert_engine_matches_transformers(folder: str, overrides: Sequence[str] = (), prompts: Sequence[list[int]] | None = None,
                                       max_tokens: int = 12, llm: Any = None, metadata: Any = None) -> Any:
    """Build an engine on ``folder`` with ``overrides``, generate greedily (each prompt with
    its ``metadata``, when given), and assert the tokens equal transformers' and that every
    cache block is free afterwards. Returns the LLM."""
    from servelab import LLM, SamplingParams

    llm = llm or LLM(folder, overrides=["model.dtype=float32", "device=cpu", *overrides])
    prompts = prompts or mixed_prompts(llm.engine.vocab_size)
    key = (folder, tuple(map(tuple, prompts)), max_tokens)
    if key not in _reference_cache:
        _reference_cache[key] = transformers_greedy(folder, prompts, max_tokens)
    expected = _reference_cache[key]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False,
                           metadata=metadata)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) with {list(overrides)}: servelab {g} != transformers {e}"
    assert_no_leaked_blocks(llm)
    return llm


def assert_tiers_whole(llm: Any) -> None:
    """With the engine idle, every host block of a paged cache's host pool is free or kept
    by the host tier, and the lower tier's index holds no more than its budget (nothing to
    check for a cache without a host pool)."""
    cache = llm.engine.cache
    if getattr(cache, "host_pool", None) is None:
        return
    cache.take_tier_moves()
    kept = len(cache.host_tier) if cache.host_tier is not None else 0
    assert cache.host_pool.num_free + kept == cache.num_host_blocks, (
        f"host blocks leaked: {cache.host_pool.num_free} free + {kept} in the host tier "
        f"of {cache.num_host_blocks}")
    if cache.lower is not None:
        index = cache.lower.index
        assert len(index) <= index.capacity, f"lower tier holds {len(index)} blocks over its {index.capacity}"


def assert_no_leaked_blocks(llm: Any) -> None:
    """Every KV block is back in the pool and no request is left in the engine."""
    engine = llm.engine
    assert not engine.has_unfinished_requests(), "requests left in the engine"
    usage = engine.cache.usage
    assert usage.used_blocks == 0, f"{usage.used_blocks} KV blocks leaked"
    assert usage.reserved_slots == 0 and usage.used_slots == 0, f"cache not empty: {usage}"
