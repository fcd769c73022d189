"""Composing ``servelab-bench`` configs in process."""

from __future__ import annotations

import pytest


@pytest.fixture
def bench_config():
    """``bench_config(*overrides)``: the composed ``conf/bench.yaml`` on the toy model."""
    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import compose_config

    def compose(*overrides: str):
        store_bench_schemas()
        return compose_config(["model=toy", "use_tqdm=false", *overrides], config_name="bench")
    return compose
