"""``servelab-bench mode=profile``: measure this machine's steps for ``cost_model=profiled``.

The engine the config builds (``executor=model``) runs synthetic steps through its real
executor: requests with random prompt tokens get blocks from ``engine.cache``, a
``SchedulerOutput`` of ``ScheduledRequest`` grants goes through
``engine.executor.submit`` and ``collect``, and the blocks are freed. The plan covers
prefills up to the scheduler's step budget, decode batches at several context lengths,
prefill chunks over a cached context, several prompts in one step, decodes mixed with a
chunk, and random held-out steps; every step is timed ``repeats`` times in shuffled
rounds (a noisy machine then slows all points alike) and its median kept; the spread of
the repeats around their medians and how long a stray persists in time are recorded
(``meta.dispersion``, ``plugins/cost_model/step_jitter.py``) for ``cost_model.jitter``.
Then real
requests run through the engine step by step to measure its host time outside the
executor (scheduling, stop checks, output rendering). ``step_table.py`` fits the step
model and the table is written to the job folder (``profile.json``) and ``mode.out``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

Step = tuple[tuple[int, int, bool], ...]
"""A synthetic step: (new tokens, context length after them, samples) per request."""


def _plan(engine: Any, mode: Any, rng: random.Random) -> list[tuple[str, Step]]:
    """(role, step) pairs: ``fit`` steps the model is fitted on, ``holdout`` steps it is checked on."""
    longest, budget = engine.max_model_len - 1, engine.max_step_tokens
    max_seqs = engine.scheduler.max_num_seqs() or 256
    plan: list[tuple[str, Step]] = []
    for n in (n for n in mode.token_grid if n <= budget):
        k = math.ceil(n / longest)
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        plan.append(("fit", tuple((q, q, True) for q in sizes)))
    contexts = sorted({1 + round(f * (longest - 1)) for f in mode.context_fractions})
    for b in (b for b in mode.batch_sizes if b <= min(max_seqs, budget)):
        plan += [("fit", ((1, c, True),) * b) for c in contexts]
    for q in mode.chunk_sizes:
        cached = [round(f * engine.max_model_len) for f in mode.cached_fractions]
        plan += [("fit", ((q, c + q, False),)) for c in cached if c + q <= engine.max_model_len and q <= budget]
    for k in mode.prompt_counts:
        plan += [("fit", ((q, q, True),) * k) for q in mode.prompt_lengths if k * q <= budget and q <= longest]
    middle = contexts[len(contexts) // 2]
    for b in mode.mixed_batch_sizes:
        for q in mode.chunk_sizes:
            if b + q <= budget and b < max_seqs and q + engine.max_model_len // 4 <= engine.max_model_len:
                plan.append(("fit", ((1, middle, True),) * b + ((q, q + engine.max_model_len // 4, False),)))
    for _ in range(mode.holdout_steps):
        step = [(1, rng.randint(1, longest), True) for _ in range(rng.randint(0, min(64, max_seqs - 3)))]
        for _ in range(rng.randint(0 if step else 1, 3)):
            q = rng.randint(2, min(256, longest))
            room = budget - sum(s[0] for s in step)
            if q <= room:
                cached = rng.randint(0, longest - q)
                step.append((q, cached + q, rng.random() < 0.5))
        plan.append(("holdout", tuple(step)))
    return [(role, step) for role, step in plan if step and _fits(engine, step)]


def _fits(engine: Any, step: Step) -> bool:
    cache = engine.cache
    return sum(-(-c // cache.block_size) for _, c, _ in step) <= cache.num_free_blocks


def _time_step(engine: Any, step: Step, params: Any, rng: random.Random) -> float:
    """Seconds the executor takes for ``step`` (blocks allocated before, freed after)."""
    from servelab.core.request import Request
    from servelab.core.scheduler import ScheduledRequest, SchedulerOutput

    grants, requests = [], []
    for i, (new, context, samples) in enumerate(step):
        request = Request(f"profile-{i}", [rng.randrange(engine.vocab_size) for _ in range(context)], params, None)
        if engine.cache.allocate(request, context) is None:
            raise RuntimeError(f"the KV cache cannot hold a {len(step)}-request profile step")
        request.num_computed_tokens = context - new
        grants.append(ScheduledRequest.of(request, new, engine.cache, samples))
        requests.append(request)
    prefill = sum(new for new, context, _ in step if new > 1 or context - new == 0)
    output = SchedulerOutput(tuple(grants), num_prefill_tokens=prefill,
                             num_decode_tokens=sum(new for new, _, _ in step) - prefill)
    started = time.perf_counter()
    engine.executor.submit(output)
    engine.executor.collect()
    seconds = time.perf_counter() - started
    for request in requests:
        engine.cache.free(request)
        engine.strategy.on_request_finished(request)
    return seconds


def _engine_overhead(system: Any, mode: Any, progress: Any) -> tuple[list[int], list[float]]:
    """Median host seconds per step outside the executor, by requests in the step: real
    requests (short prompts, 1..64 output tokens) run through ``system.step()``."""
    from servelab.bench.workload import BenchRequest

    engine = system.engine
    executor = engine.executor
    spent = {"seconds": 0.0, "requests": 0}
    submit, collect = executor.submit, executor.collect

    def timed_submit(output):
        started = time.perf_counter()
        submit(output)
        spent["seconds"] += time.perf_counter() - started
        spent["requests"] = len(output.scheduled)

    def timed_collect():
        started = time.perf_counter()
        executed = collect()
        spent["seconds"] += time.perf_counter() - started
        return executed

    executor.submit, executor.collect = timed_submit, timed_collect
    samples: list[tuple[int, float]] = []
    rng = random.Random(mode.seed)
    count = min(mode.overhead_requests, engine.scheduler.max_num_seqs() or mode.overhead_requests)
    try:
        system.begin()
        for round_ in range(mode.overhead_rounds):
            for i in range(count):
                prompt = tuple(rng.randrange(engine.vocab_size) for _ in range(rng.randint(8, 32)))
                system.add(BenchRequest(f"overhead-{round_}-{i}", prompt, 1 + i % 64, 0.0), engine.clock.now())
            while system.has_work():
                spent["seconds"] = 0.0
                started = time.perf_counter()
                system.step()
                samples.append((spent["requests"], time.perf_counter() - started - spent["seconds"]))
            progress.update(1)
    finally:
        system.end()
        del executor.submit, executor.collect
    grid = [r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if r <= max(count, 1)]
    bins: dict[int, list[float]] = {r: [] for r in grid}
    for requests, seconds in samples:
        if requests:
            bins[min(grid, key=lambda r: abs(math.log(r) - math.log(requests)))].append(seconds)
    kept = [r for r in grid if bins[r]]
    return kept, [statistics.median(bins[r]) for r in kept]


def _machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "load_average": list(os.getloadavg())}


def _row_buckets(engine: Any) -> list[int]:
    """The row counts servelab's CPU matmuls pad a step's tokens to (none off the CPU path
    and for float32, whose blocked matmul takes any row count)."""
    from servelab.plugins.models.linear import padded_rows, pads_rows

    if engine.device.type != "cpu" or not pads_rows(engine.dtype):
        return []
    return sorted({padded_rows(n) for n in range(1, engine.max_step_tokens + 1)})


def profile(cfg: DictConfig, folder: Path, command: str) -> dict[str, Any]:
    """Run the profile; write the table; return the metrics (fit errors, table path)."""
    from tqdm.auto import tqdm

    from servelab.bench.targets.inproc import ServelabSystem
    from servelab.core.cost_model import BatchShape
    from servelab.core.errors import ConfigError
    from servelab.core.sampling_params import SamplingParams
    from servelab.plugins.cost_model.operators import window_groups
    from servelab.plugins.cost_model.step_jitter import dispersion_quantiles, fit_persistence, lag_correlations
    from servelab.plugins.cost_model.step_table import StepTableModel, build_step_series, fit_step_model, relative_errors
    from servelab.plugins.cost_model.table import CostTable, save_table

    mode = cfg.mode
    if mode.repeats < 1:
        raise ConfigError([f"mode.repeats must be >= 1, got {mode.repeats}"])
    system = ServelabSystem(cfg)
    engine = system.engine
    try:
        if not engine.executor.runs_model:
            raise ConfigError(["mode=profile times the real forward pass: use executor=model"])
        rng = random.Random(mode.seed)
        engine.warm_up()
        plan = _plan(engine, mode, rng)
        params = SamplingParams(temperature=cfg.workload.temperature, max_tokens=1, ignore_eos=True, seed=mode.seed)
        times: list[list[float]] = [[] for _ in plan]
        starts: list[list[float]] = [[] for _ in plan]
        machine = _machine()
        order = list(range(len(plan)))
        began = time.perf_counter()
        with tqdm(total=len(plan) * mode.repeats + mode.overhead_rounds, desc="profile", unit="step",
                  disable=not cfg.use_tqdm, dynamic_ncols=True) as bar:
            for _ in range(mode.repeats):
                rng.shuffle(order)
                for index in order:
                    starts[index].append(time.perf_counter() - began)
                    times[index].append(_time_step(engine, plan[index][1], params, rng))
                    bar.update(1)
            overhead_grid, overhead = _engine_overhead(system, mode, bar)
    finally:
        system.close()
    batches = [BatchShape(tuple(q for q, _, _ in s), tuple(c for _, c, _ in s), sum(x for _, _, x in s))
               for _, s in plan]
    medians = [statistics.median(t) for t in times]
    correlations = lag_correlations([(start, index, seconds / medians[index]) for index in range(len(plan))
                                     for start, seconds in zip(starts[index], times[index])])
    persistence = fit_persistence(correlations)
    fit = [i for i, (role, _) in enumerate(plan) if role == "fit"]
    buckets = _row_buckets(engine)
    grid = sorted({n for n in mode.token_grid if n <= engine.max_step_tokens})
    linear, scalars = fit_step_model([batches[i] for i in fit], [medians[i] for i in fit], grid, buckets)
    shape = engine.shape
    meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "machine": machine, "row_buckets": buckets,
            "engine": {"attention": engine.registry.spec_for_config("attention", engine.cfg.attention).name,
                       "scheduler": engine.registry.spec_for_config("scheduler", engine.cfg.scheduler).name,
                       "max_model_len": engine.max_model_len, "max_step_tokens": engine.max_step_tokens,
                       "quantization": engine.quantization.mode if engine.quantization else "none",
                       "repeats": mode.repeats},
            "dispersion": {"step_time_over_median": dispersion_quantiles(times) if mode.repeats > 1 else [],
                           "samples": len(plan) * mode.repeats,
                           "persistence": [list(component) for component in persistence],
                           "lag_correlations": [[round(s, 4), round(r, 4), n] for s, r, n in correlations]},
            "measurements": [{"role": role, "steps": [list(x) for x in _runs(step)], "seconds": round(m, 6),
                              "min": round(min(t), 6), "max": round(max(t), 6)}
                             for (role, step), m, t in zip(plan, medians, times)]}
    model = {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "num_heads": shape.num_heads,
             "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
             "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
             "tied_embeddings": shape.tied_embeddings}
    series = build_step_series(grid, linear, scalars, overhead_grid, overhead)
    table = CostTable("steps", (cfg.hardware.name,), series, model, str(engine.dtype).removeprefix("torch."), meta)
    steps = StepTableModel(table, window_groups(shape))
    predicted = [sum(s for _, s in steps.forward_time(b)) for b in batches]
    meta["fit"] = {role: {"points": len(idx), **relative_errors([predicted[i] for i in idx], [medians[i] for i in idx])}
                   for role in ("fit", "holdout") for idx in [[i for i, (r, _) in enumerate(plan) if r == role]]}
    path = save_table(table, folder / "profile.json")
    if mode.out:
        save_table(table, Path(mode.out))
    return {"table": str(path), "out": mode.out, "points": len(plan), "repeats": mode.repeats,
            "fit": meta["fit"], "scalars": scalars,
            "persistence": [list(component) for component in persistence],
            "engine_overhead_s": dict(zip(overhead_grid, overhead)),
            "machine": machine}


def _runs(step: Step) -> list[tuple[int, int, bool, int]]:
    """``step`` as runs of identical requests: (new tokens, context, samples, count)."""
    runs: list[list] = []
    for request in step:
        if runs and tuple(runs[-1][:3]) == request:
            runs[-1][3] += 1
        else:
            runs.append([*request, 1])
    return [tuple(r) for r in runs]
