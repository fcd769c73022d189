"""Compose a servelab config from overrides, inside or outside a running Hydra app."""

from __future__ import annotations

from omegaconf import DictConfig

from servelab.core.config import store_schemas
from servelab.core.engine.registry import get_registry


def prepare_hydra() -> None:
    """Register schemas and every plugin's config node before Hydra composes."""
    store_schemas()
    get_registry()


def compose_config(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``["cache=contiguous"]``)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    prepare_hydra()
    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=overrides)
    with initialize_config_module(config_module="servelab.conf", version_base=None):
        return compose(config_name=config_name, overrides=overrides)
