"""``attention=auto``: the fastest backend that can run the model on this device."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from servelab.core.attention import AttentionBackend, AttentionSpec
from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError

PREFERENCE = {"cpu": ("cpu",)}
"""Backends tried first, in order, per device type."""
FALLBACK = "sdpa"
"""The backend when none of the preferred ones can run (it runs on every device)."""


@dataclass
class AutoAttentionConfig:
    """``attention=auto``: no options."""


class AutoAttention(AttentionBackend):
    """A selector, not a backend: the engine replaces it (``resolve``) by the first
    backend of ``PREFERENCE`` for the device that reports no reason it cannot run —
    ``cpu`` (native C++) on CPU when it builds and supports the head size, else ``sdpa``."""

    @classmethod
    def resolve(cls, config, spec: AttentionSpec, registry):
        """The chosen backend's default config."""
        for name in PREFERENCE.get(spec.device.type, ()):
            candidate = registry.get("attention", name)
            chosen = OmegaConf.structured(candidate.config_cls)
            if not candidate.cls.unsupported_reasons(OmegaConf.to_object(chosen), spec):
                return chosen
        return OmegaConf.structured(registry.get("attention", FALLBACK).config_cls)

    def forward(self, q, k, v, kv_cache, meta, layer_index):
        """Never runs: the engine builds the backend ``resolve`` picks."""
        raise ConfigError(["attention=auto must be resolved by the engine before it is built"])


SPEC = ComponentSpec("attention", "auto", AutoAttention, AutoAttentionConfig,
                     "picks the fastest backend for the device: cpu (native) on CPU, else sdpa (default)")
