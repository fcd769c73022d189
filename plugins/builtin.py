"""Registers servelab's built-in components through the same hooks third parties use."""

from __future__ import annotations

from servelab.core.hookspecs import hookimpl

SERVELAB_PLUGIN_API = ">=1.0,<2"
"""The plugin API versions the built-ins are written against (``core/plugin_api.py``)."""


@hookimpl
def servelab_register_schedulers():
    """static, dynamic, continuous and chunked-prefill batching."""
    from servelab.plugins.scheduler import chunked, continuous, dynamic, static

    return [static.SPEC, dynamic.SPEC, continuous.SPEC, chunked.SPEC]


@hookimpl
def servelab_register_kv_caches():
    """paged and contiguous caches."""
    from servelab.plugins.cache import contiguous, paged

    return [paged.SPEC, contiguous.SPEC]


@hookimpl
def servelab_register_attention_backends():
    """naive, sdpa, cpu (native C++) and flash (Triton) attention, and auto (picks one)."""
    from servelab.plugins.attention import auto, cpu, flash, naive, sdpa

    return [naive.SPEC, sdpa.SPEC, cpu.SPEC, flash.SPEC, auto.SPEC]


@hookimpl
def servelab_register_decoding_strategies():
    """greedy, sampling, and speculative (draft model, n-gram, EAGLE-style head) decoding."""
    from servelab.plugins.decoding import eagle, greedy, ngram, sampling, speculative

    return [greedy.SPEC, sampling.SPEC, speculative.SPEC, ngram.SPEC, eagle.SPEC]


@hookimpl
def servelab_register_models():
    """The Llama family, Phi-3, OPT, Falcon, Gemma 2, Gemma 3, DeepSeek-V2 (dense), Mixtral, Qwen2-MoE and
    Qwen3-MoE architectures."""
    from servelab.plugins.models import deepseek, falcon, gemma, llama, mixtral, opt, phi3, qwen_moe

    return (llama.model_specs() + phi3.model_specs() + opt.model_specs() + falcon.model_specs() + gemma.model_specs()
            + deepseek.model_specs() + mixtral.model_specs() + qwen_moe.model_specs())


@hookimpl
def servelab_register_eviction_policies():
    """LRU, LFU and ARC eviction for the prefix cache."""
    from servelab.plugins.cache import arc, lfu, lru

    return [lru.SPEC, lfu.SPEC, arc.SPEC]


@hookimpl
def servelab_register_kv_tiers():
    """disk: cached KV blocks in files below the host tier."""
    from servelab.plugins.kv_tier import disk

    return [disk.SPEC]


@hookimpl
def servelab_register_lora_stores():
    """local (the folder each load names) and directory (every adapter folder under a root, by name)."""
    from servelab.plugins.lora_store import directory, local

    return [local.SPEC, directory.SPEC]


@hookimpl
def servelab_register_executors():
    """model (the forward pass) and simulated (a cost model on a virtual clock)."""
    from servelab.plugins.executor import model, simulated

    return [model.SPEC, simulated.SPEC]


@hookimpl
def servelab_register_routers():
    """round_robin, least_loaded, prefix_affinity and kv_aware replica routing."""
    from servelab.plugins.router import kv_aware, least_loaded, prefix_affinity, round_robin

    return [round_robin.SPEC, least_loaded.SPEC, prefix_affinity.SPEC, kv_aware.SPEC]


@hookimpl
def servelab_register_policies():
    """fcfs, priority, vtc (fair share per tenant) and deadline (earliest deadline first) policies."""
    from servelab.plugins.policy import deadline, fcfs, priority, vtc

    return [fcfs.SPEC, priority.SPEC, vtc.SPEC, deadline.SPEC]


@hookimpl
def servelab_register_kv_transfers():
    """shared_memory (memory-backed files between instances on one host) and
    torch_distributed (send/recv over torch.distributed, on one host or several)."""
    from servelab.plugins.kv_transfer import shared_memory, torch_distributed
    from servelab.plugins.kv_transfer import simulated  # simulated engines: no bytes, each transfer priced

    return [shared_memory.SPEC, torch_distributed.SPEC, simulated.SPEC]


@hookimpl
def servelab_register_cost_models():
    """roofline (FLOPs and bytes on the hardware's roofline) and profiled (measured tables)."""
    from servelab.plugins.cost_model import profiled, roofline

    return [roofline.SPEC, profiled.SPEC]
