"""Attention backends: naive (reference), sdpa (fast CPU path) and flash (Triton)."""
