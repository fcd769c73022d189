"""A ``servelab-serve`` in a subprocess on 127.0.0.1: the one way the server tests, the
entry-point kit and the benchmarks start a server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from servelab.platform import free_port

STARTUP_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
MODULE_COMMAND = (sys.executable, "-m", "servelab.server")


class ServerProcess:
    """``command`` (default ``python -m servelab.server``) with the Hydra ``overrides``,
    on a free port, logging to ``log_path``; the constructor returns once ``/health``
    answers (raising ``RuntimeError`` with the log if the server exits or does not start
    within ``startup_timeout_s``). ``env``: variables added to this process's (one compute
    thread by default). ``stop`` sends SIGTERM and returns the exit status."""

    def __init__(self, log_path: Path | str, *overrides: str, command: Sequence[str] = MODULE_COMMAND,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        args = [*command, f"server.port={self.port}", "server.access_log=false", *overrides]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=environment)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-5000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f}s:\n{self.log()[-5000:]}")

    @property
    def pid(self) -> int:
        """The server process's id."""
        return self.process.pid

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, wait, and return the exit status (SIGKILL after ``STOP_TIMEOUT_S``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
