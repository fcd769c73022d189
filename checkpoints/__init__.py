"""Checkpoints shipped with servelab: the trained `tiny` target and `tiny-draft` models."""
