"""servelab: a plugin-based, modular LLM serving framework.

The public API: ``LLM`` for offline generation, ``SamplingParams`` per request
(``RequestMetadata``: its priority, tenant, deadline and SLO class),
``LLMEngine`` for step-by-step control (``BeamSearch`` runs beam search over it), the
output types, and ``PLUGIN_API_VERSION``, the plugin API plugins declare support for. They are imported on first
access, so ``import servelab.<module>`` does not load torch by itself (tools and the
server's processes import only what they use).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "servelab.core.entrypoints.llm",
    "LLMEngine": "servelab.core.engine.llm_engine",
    "BeamSearch": "servelab.core.entrypoints.beam_search",
    "PLUGIN_API_VERSION": "servelab.core.plugin_api",
    "SamplingParams": "servelab.core.sampling_params",
    "RequestMetadata": "servelab.core.request_metadata",
    "StructuredOutputParams": "servelab.core.structured_output",
    "RequestOutput": "servelab.core.outputs",
    "CompletionOutput": "servelab.core.outputs",
    "ConfigError": "servelab.core.errors",
    "InvalidRequestError": "servelab.core.errors",
    "EngineShutdownError": "servelab.core.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Import a public name from its module on first access."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'servelab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
