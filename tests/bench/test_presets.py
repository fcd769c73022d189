"""Every experiment preset composes for every combination of its sweep."""

from __future__ import annotations

import importlib.resources
import itertools

import pytest
import yaml
from omegaconf import OmegaConf

from servelab.core.engine.registry import get_registry

CONF = importlib.resources.files("servelab.conf")
PRESETS = sorted(p.name[:-5] for p in CONF.joinpath("experiment").iterdir() if p.name.endswith(".yaml"))


def sweep_axes(name: str) -> list[list[str]]:
    """The overrides of each axis of ``servelab-bench -m experiment=<name>``'s sweep."""
    params = OmegaConf.load(str(CONF.joinpath("experiment", f"{name}.yaml"))).hydra.sweeper.params
    return [[f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()]


def sweep_overrides(name: str) -> list[list[str]]:
    """The job overrides ``servelab-bench -m experiment=<name>`` runs."""
    return [list(job) for job in itertools.product(*sweep_axes(name))]


def composition_jobs(name: str) -> list[list[str]]:
    """The jobs that compose differently: every choice of every config-group axis with the
    first value of every value axis (``workload.rate=...``: a value changes what a job
    runs, not what composes)."""
    axes = [axis if "." not in axis[0].split("=")[0] else axis[:1] for axis in sweep_axes(name)]
    return [list(job) for job in itertools.product(*axes)]


def test_the_presets_exist():
    assert {"batching", "chunk_size", "kv_waste", "orca_iteration_level", "sarathi_capacity", "spec_decode_theory",
            "spec_k", "vllm_paper"} <= set(PRESETS)
    assert sweep_overrides("batching")[0] == ["scheduler=static", "workload.rate=8"]
    assert {job[0] for job in sweep_overrides("batching")} == {
        "scheduler=static", "scheduler=dynamic", "scheduler=continuous", "scheduler=chunked"}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_for_every_job(bench_config, name):
    """Every config-group choice of the sweep composes, pins its threads and sets its values."""
    if name == "spec_k" and "speculative" not in get_registry().specs("decoding"):
        pytest.skip("decoding=speculative is not registered yet")
    for job in composition_jobs(name):
        cfg = bench_config(f"experiment={name}", *job)
        assert cfg.torch_threads in (1, 2), "a preset pins its compute threads, so its runs repeat"
        for override in job:
            key, value = override.split("=")
            if "." in key:
                assert OmegaConf.select(cfg, key.lstrip("+")) == yaml.safe_load(value)
