"""Scheduling policies: static, dynamic, continuous and chunked-prefill batching."""
