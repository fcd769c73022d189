"""Hydra configs: the primary ``config.yaml``, model presets and experiment presets."""
