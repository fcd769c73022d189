"""The process that holds the engine of ``servelab-serve``.

The HTTP server and the engine share no interpreter lock and no threads: the engine
process builds the ``LLMEngine``, compiles its CPU matmul kernels, then runs an
``EngineLoop``; the server process talks to it through a pipe. By default the engine
computes on every core this process may use: the HTTP side needs little time, and at the
online loads measured on two cores (docs/results/performance.md) one compute thread falls
behind where two keep up.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any

from omegaconf import DictConfig

from servelab.core.errors import ConfigError
from servelab.kernels.libc import die_with_parent
from servelab.server.messages import EngineConfigError, EngineInfo, EngineReady

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long ``join`` waits for the engine process to exit before killing it."""


def default_engine_threads() -> int:
    """Every core this process may use."""
    return len(os.sched_getaffinity(0))


class EngineProcess:
    """Handle on the engine process: ``launch`` it, ``send`` commands, ``recv`` messages
    (see ``engine_loop``), ``join`` it at shutdown."""

    def __init__(self, process: multiprocessing.Process, conn: Any, info: EngineInfo):
        self.process = process
        self.conn = conn
        self.info = info

    @classmethod
    def launch(cls, cfg: DictConfig, threads: int | None, warmup_tokens: int | None) -> "EngineProcess":
        """Start the engine process and wait until it serves. Raises ``ConfigError`` for a
        bad configuration and ``RuntimeError`` if the process dies while starting."""
        problems = []
        if threads is not None and threads < 1:
            problems.append(f"server.engine_threads must be at least 1 (or null for every core), got {threads}")
        if warmup_tokens is not None and warmup_tokens < 0:
            problems.append(f"server.warmup_tokens must be 0 (no warm-up), more, or null (the step budget), "
                            f"got {warmup_tokens}")
        if problems:
            raise ConfigError(problems)
        from servelab.core.config import resolved

        context = multiprocessing.get_context("spawn")
        server_end, engine_end = context.Pipe()
        process = context.Process(target=_engine_main, name="servelab-engine", daemon=False,
                                  args=(resolved(cfg), engine_end, threads or default_engine_threads(), warmup_tokens))
        process.start()
        engine_end.close()
        try:
            message = server_end.recv()
        except EOFError:
            process.join()
            raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting") from None
        if isinstance(message, EngineConfigError):
            process.join()
            raise ConfigError(list(message.problems))
        return cls(process, server_end, message.info)

    def send(self, message: Any) -> None:
        """Send one command (``server/messages.py``) to the engine loop."""
        self.conn.send(message)

    def recv(self) -> Any:
        """The next message from the engine loop; ``EOFError`` once the process is gone."""
        return self.conn.recv()

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


def _engine_main(cfg: DictConfig, conn: Any, threads: int, warmup_tokens: int | None) -> None:
    """Entry point of the engine process."""
    # The server process decides when the engine stops; a Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)  # a server killed outright takes its engine (and workers) along
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    import torch

    from servelab.core.engine import LLMEngine
    from servelab.server.engine_loop import EngineLoop

    torch.set_num_threads(threads)
    try:
        engine = LLMEngine(cfg)
    except ConfigError as exc:
        conn.send(EngineConfigError(tuple(exc.problems)))
        return
    warm_up(engine, warmup_tokens)
    conn.send(EngineReady(EngineInfo.of(engine)))
    log.info("engine ready (%d compute threads)", threads)
    EngineLoop(engine, conn).run()


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
