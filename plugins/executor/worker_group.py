"""The ranks a parallel ``executor=model`` starts, and their release.

On one node the driver starts ranks 1.. as ``python -m servelab.plugins.executor.worker_main``
processes, with the driver's import path, that read their ``WorkerSpec`` from stdin. Unlike ``multiprocessing``'s spawn,
a worker never re-imports the driver's main module (a script that builds a parallel
``LLM`` at top level needs no ``if __name__ == "__main__":`` guard) and leaves no
resource-tracker process behind.

``WorkerGroup`` is everything the executor's ranks hold in the driver's process: the
worker processes, the ``torch.distributed`` process group and the number of torch
threads it replaced. ``close`` releases all of it once; the executor calls it from
``shutdown`` and from a ``weakref.finalize`` (when the executor is collected, or at
interpreter exit), so no strong reference keeps an engine alive.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

WORKER_MODULE = "servelab.plugins.executor.worker_main"
STOP_TIMEOUT_S = 30.0
"""How long ``close`` waits for a worker to exit after the stop message before killing it."""


class WorkerProcess:
    """Handle on one spawned rank: ``pid``, ``is_alive``, ``exitcode``, ``join``, ``kill``."""

    def __init__(self, rank: int, popen: subprocess.Popen):
        self.rank = rank
        self.popen = popen

    @classmethod
    def start(cls, spec: Any) -> "WorkerProcess":
        """Start rank ``spec.rank``: this interpreter running ``WORKER_MODULE`` with this
        process's ``sys.path`` (what the driver imported, the worker finds) and the pickled
        ``spec`` on stdin."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        popen = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, env=env)
        with popen.stdin:
            pickle.dump(spec, popen.stdin)
        return cls(spec.rank, popen)

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while it runs."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        """True while the process runs."""
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the process to exit."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        self.popen.kill()
        self.popen.wait()

    def __repr__(self) -> str:
        return f"rank {self.rank} (pid {self.pid}, exit code {self.exitcode})"


def describe_dead(workers: list[WorkerProcess]) -> str | None:
    """Which workers have exited, if any."""
    return ", ".join(repr(w) for w in workers if not w.is_alive()) or None


class WorkerGroup:
    """The ranks of one executor as its driver holds them: ``workers`` (the processes it
    started; none under ``torchrun``), whether it joined the process group (``joined``),
    and the torch thread count it replaced. ``stop_workers(ranks)`` sends the ranks the
    stop message."""

    def __init__(self, stop_workers: Callable[[range], None], world_size: int):
        self.stop_workers = stop_workers
        self.world_size = world_size
        self.workers: list[WorkerProcess] = []
        self.joined = False
        self.threads_before: int | None = None
        self.closed = False

    def use_threads(self, threads: int) -> None:
        """Compute on ``threads`` torch threads in this process until ``close``."""
        if self.threads_before is None:
            self.threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)

    def close(self) -> None:
        """Stop the workers (the stop message, then a kill past ``STOP_TIMEOUT_S``), leave
        and destroy the process group and restore the torch thread count; once."""
        if self.closed:
            return
        self.closed = True
        joined = self.joined and dist.is_initialized()
        if joined:
            try:
                self.stop_workers(range(1, self.world_size))
            except RuntimeError:  # a worker died: the others are killed below
                pass
        for worker in self.workers:
            worker.join(STOP_TIMEOUT_S)
            if worker.is_alive():
                log.warning("parallel worker %r did not stop within %.0fs: killing it", worker, STOP_TIMEOUT_S)
                worker.kill()
        if joined:
            dist.destroy_process_group()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        if self.workers:
            log.info("parallel workers stopped (exit codes %s)", ", ".join(str(w.exitcode) for w in self.workers))
