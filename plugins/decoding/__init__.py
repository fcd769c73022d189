"""Decoding strategies: greedy, sampling, and speculative decoding."""
