"""Registers servelab's built-in components through the same hooks third parties use."""

from __future__ import annotations

from servelab.core.hookspecs import hookimpl


@hookimpl
def servelab_register_schedulers():
    """static and continuous batching."""
    from servelab.plugins.scheduler import continuous, static

    return [static.SPEC, continuous.SPEC]


@hookimpl
def servelab_register_kv_caches():
    """paged and contiguous caches."""
    from servelab.plugins.cache import contiguous, paged

    return [paged.SPEC, contiguous.SPEC]


@hookimpl
def servelab_register_attention_backends():
    """naive and sdpa attention."""
    from servelab.plugins.attention import naive, sdpa

    return [naive.SPEC, sdpa.SPEC]


@hookimpl
def servelab_register_decoding_strategies():
    """greedy and sampling decoding."""
    from servelab.plugins.decoding import greedy, sampling

    return [greedy.SPEC, sampling.SPEC]


@hookimpl
def servelab_register_models():
    """The Llama family architectures."""
    from servelab.plugins.models import llama

    return llama.model_specs()
