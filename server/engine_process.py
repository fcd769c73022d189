"""The process that holds the engine of ``servelab-serve``.

The HTTP server and the engine share no interpreter lock and no threads: the engine
process builds the ``LLMEngine``, compiles its CPU matmul kernels, then runs an
``EngineLoop``; the server process talks to it through a pipe. By default the engine
computes on every core this process may use: the HTTP side needs little time, and at the
online loads measured on two cores (docs/results/performance.md) one compute thread falls
behind where two keep up. It runs at a lower scheduling priority (``server.engine_nice``),
so that the little time the HTTP side needs preempts the engine's threads at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Sequence

from omegaconf import DictConfig

from servelab.core.errors import ConfigError
from servelab.platform import die_with_parent
from servelab.server.messages import EngineConfigError, EngineInfo, EngineReady, StopEngine

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long ``join`` waits for the engine process to exit before killing it."""

MAX_NICE = 19
"""The largest nice increment: the lowest priority Unix schedulers give."""


def default_engine_threads() -> int:
    """Every core this process may use."""
    return len(os.sched_getaffinity(0))


class EngineProcess:
    """Handle on the engine process: ``launch`` it, trade messages over ``conn`` (its end
    of the pipe; the commands and messages of ``engine_loop``), ``join`` it at shutdown."""

    def __init__(self, process: multiprocessing.Process, conn: Any, info: EngineInfo, name: str = "engine"):
        self.process = process
        self.conn = conn
        self.info = info
        self.name = name

    @classmethod
    def launch(cls, cfg: DictConfig, threads: int | None = None) -> "EngineProcess":
        """Start the engine process of the ``servelab-serve`` config ``cfg`` and wait until
        it serves: ``threads`` compute threads (default ``server.engine_threads``), the
        warm-up of ``server.warmup_tokens``, the priority of ``server.engine_nice``.
        Raises ``ConfigError`` for a bad configuration and ``RuntimeError`` if the process
        dies while starting."""
        threads = cfg.server.engine_threads if threads is None else threads
        return cls.launch_all([InstancePlan("engine", cfg, threads)], cfg.server)[0]

    @classmethod
    def launch_all(cls, plans: Sequence["InstancePlan"], server: Any) -> list["EngineProcess"]:
        """Start one engine process per plan, all at once, and wait until every one
        serves (``server``: the ``server`` node, for warm-up and priority). If any fails
        to start, the others are stopped and its error raised."""
        warmup_tokens, nice = server.warmup_tokens, server.engine_nice
        problems = []
        for plan in plans:
            if plan.threads is not None and plan.threads < 1:
                problems.append(f"server.engine_threads must be at least 1 (or null for every core), got {plan.threads}")
        if not 0 <= nice <= MAX_NICE:
            problems.append(f"server.engine_nice must be between 0 and {MAX_NICE} (a Unix nice increment), got {nice}")
        if warmup_tokens is not None and warmup_tokens < 0:
            problems.append(f"server.warmup_tokens must be 0 (no warm-up), more, or null (the step budget), "
                            f"got {warmup_tokens}")
        if problems:
            raise ConfigError(problems)
        from servelab.core.config import resolved

        context = multiprocessing.get_context("spawn")
        started = []
        for plan in plans:
            server_end, engine_end = context.Pipe()
            process = context.Process(target=_engine_main, name=f"servelab-{plan.name}", daemon=False,
                                      args=(resolved(plan.cfg), engine_end, plan.name,
                                            plan.threads or default_engine_threads(), plan.cores, warmup_tokens,
                                            nice))
            process.start()
            engine_end.close()
            started.append((plan, process, server_end))
        engines, failure = [], None
        for plan, process, conn in started:
            try:
                message = conn.recv()
            except EOFError:
                message = None
            if isinstance(message, EngineReady):
                engines.append(cls(process, conn, message.info, plan.name))
                continue
            process.join()
            conn.close()
            if failure is None:
                failure = (ConfigError(list(message.problems)) if isinstance(message, EngineConfigError) else
                           RuntimeError(f"the engine process {plan.name} exited with code {process.exitcode} "
                                        f"while starting"))
        if failure is not None:
            for engine in engines:
                engine.stop()
            raise failure
        return engines

    def stop(self) -> None:
        """Send the stop command (if the process still listens) and ``join``."""
        try:
            self.conn.send(StopEngine())
        except OSError:
            pass
        self.join()

    def join(self) -> None:
        """Wait for the process to exit after the stop command (killing it past
        ``STOP_TIMEOUT_S``) and close the pipe."""
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %.0fs: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join()
        self.conn.close()

    @property
    def exitcode(self) -> int | None:
        """The process's exit status (None while it runs)."""
        return self.process.exitcode


@dataclass(frozen=True, slots=True)
class InstancePlan:
    """One engine process to start: its ``name`` (unique in the deployment, the KV
    connector's instance id), its engine config (``role`` included), ``threads`` compute
    threads (None: every core it may use) and the ``cores`` it is pinned to (None: not
    pinned)."""

    name: str
    cfg: DictConfig
    threads: int | None = None
    cores: tuple[int, ...] | None = None


def _engine_main(cfg: DictConfig, conn: Any, name: str, threads: int, cores: tuple[int, ...] | None,
                 warmup_tokens: int | None, nice: int) -> None:
    """Entry point of the engine process."""
    if cores is not None:
        os.sched_setaffinity(0, cores)  # before any compute thread starts
    if nice:
        lower_priority(nice)  # before torch starts its compute threads, which take it over
    # The server process decides when the engine stops; a Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)  # a server killed outright takes its engine (and workers) along
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    import torch

    from servelab.core.engine.llm_engine import LLMEngine
    from servelab.server.engine_loop import EngineLoop

    torch.set_num_threads(threads)
    engine = connector = None
    try:
        engine = LLMEngine(cfg)
        connector = build_connector(engine, name)
    except ConfigError as exc:
        conn.send(EngineConfigError(tuple(exc.problems)))
        if engine is not None:
            engine.shutdown()
        return
    warm_up(engine, warmup_tokens)
    conn.send(EngineReady(EngineInfo.of(engine)))
    log.info("%s ready (role %s, pid %d, %d compute threads%s)", name, engine.cfg.role, os.getpid(), threads,
             f", cores {list(cores)}" if cores is not None else "")
    EngineLoop(engine, conn, connector).run()


def build_connector(engine: Any, name: str) -> Any:
    """The ``kv_transfer`` connector of a prefill or decode engine (None for a mixed one);
    ``ConfigError`` when its executor cannot hand KV caches over."""
    role = engine.cfg.role
    if role == "mixed":
        return None
    caches = engine.executor.local_kv_caches()
    if caches is None or (caches and caches[0].is_meta):
        executor = engine.registry.spec_for_config("executor", engine.cfg.executor).name
        raise ConfigError([f"role={role} needs the whole KV cache in one process: executor={executor} with "
                           f"parallel.tensor_parallel_size={engine.cfg.parallel.tensor_parallel_size} and "
                           f"parallel.pipeline_parallel_size={engine.cfg.parallel.pipeline_parallel_size} cannot "
                           f"hand it over (use one device per instance running the model; simulated pools run "
                           f"under servelab-bench)"])
    from servelab.core.kv_transfer import KVTransferContext

    return engine.registry.build("kv_transfer", engine.cfg.kv_transfer, KVTransferContext(name, engine.registry))


def lower_priority(increment: int) -> None:
    """Lower this process's scheduling priority by the nice ``increment`` (at most to
    ``MAX_NICE``). Linux keeps a priority per thread and a new thread takes its creator's,
    so every thread the process has so far is lowered (imports may have started some)."""
    target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, 0) + increment)
    tasks = f"/proc/{os.getpid()}/task"
    threads = [int(tid) for tid in os.listdir(tasks)] if os.path.isdir(tasks) else [0]
    for thread in threads:
        os.setpriority(os.PRIO_PROCESS, thread, target)


def warm_up(engine: Any, max_tokens: int | None) -> None:
    """Pack the weights and compile the model's CPU matmul kernels for steps of up to
    ``max_tokens`` tokens (None: the engine's step budget; each new step size would
    otherwise cost milliseconds per layer on first use)."""
    if max_tokens is None:
        max_tokens = engine.max_step_tokens
    if max_tokens <= 0:
        return
    started = time.perf_counter()
    kernels = engine.warm_up(max_tokens)
    if kernels:
        log.info("warmed up %d matmul kernels (steps up to %d tokens) in %.1f s", kernels, max_tokens,
                 time.perf_counter() - started)
