"""Console entry point ``servelab-bench``: one measurement per Hydra job."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def job_info(cfg: DictConfig) -> dict[str, Any]:
    """The job's number, label and command-line overrides (sweep tables group by them)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    return {"num": OmegaConf.select(hydra_cfg, "job.num", default=0) or 0, "label": cfg.label,
            "overrides": list(hydra_cfg.overrides.task), "mode": hydra_cfg.runtime.choices.get("mode")}


def bench(cfg: DictConfig) -> dict[str, Any]:
    """Measure the configured system; writes ``config.yaml`` (resolved), ``metrics.json``
    and ``samples.json`` into the job's output folder and prints a summary table."""
    from hydra.core.hydra_config import HydraConfig

    from servelab.bench.capacity import measure_capacity
    from servelab.bench.config import CapacityModeConfig, ProfileModeConfig
    from servelab.bench.report import summary_table
    from servelab.bench.runner import measure, open_system

    if cfg.torch_threads is not None:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    folder = Path(HydraConfig.get().runtime.output_dir)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if OmegaConf.get_type(cfg.mode) is ProfileModeConfig:
        from servelab.bench.profile import profile

        command = "servelab-bench " + " ".join(job_info(cfg)["overrides"])
        metrics = {"job": job_info(cfg), **profile(cfg, folder, command)}
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(json.dumps({k: metrics[k] for k in ("table", "points", "fit", "scalars", "engine_overhead_s")}, indent=1))
        return metrics
    started = time.perf_counter()
    system = open_system(cfg, str(folder))
    try:
        capacity = OmegaConf.get_type(cfg.mode) is CapacityModeConfig
        metrics = measure_capacity(system, cfg) if capacity else measure(system, cfg)
    finally:
        system.close()
    samples = metrics.pop("samples")
    wall_time = time.perf_counter() - started
    metrics = {"job": job_info(cfg), "simulated": system.simulated, "wall_time_s": wall_time, **metrics}
    if system.simulated:
        metrics["simulated_seconds_per_wall_second"] = metrics["duration_s"] / wall_time
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (folder / "samples.json").write_text(json.dumps(samples) + "\n")
    print(summary_table(metrics))
    print(f"metrics: {folder / 'metrics.json'}")
    return metrics


def run(cfg: DictConfig) -> None:
    """Hydra task: ``bench(cfg)``. A single run exits with status 2 on configuration and
    request errors. A sweep job (``-m``) records any error in its folder's ``error.json``
    and returns, wherever the launcher ran it, so the other jobs and the sweep report go
    on; the report names the failed jobs and the sweep exits with status 1."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from servelab.bench.job_failure import record_failure
    from servelab.core.errors import ConfigError, InvalidRequestError

    try:
        bench(cfg)
    except Exception as exc:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            path = record_failure(Path(hydra_cfg.runtime.output_dir), job_info(cfg), exc)
            print(f"servelab-bench: job {hydra_cfg.job.num} failed: {type(exc).__name__}: {exc} ({path})",
                  file=sys.stderr)
            return
        if not isinstance(exc, (ConfigError, InvalidRequestError)):
            raise
        print(f"servelab-bench: error: {exc}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """``servelab-bench [overrides...]``: Hydra app over ``conf/bench.yaml``."""
    import hydra

    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import prepare_hydra

    prepare_hydra()
    store_bench_schemas()
    hydra.main(config_path="pkg://servelab.conf", config_name="bench", version_base=None)(run)()
