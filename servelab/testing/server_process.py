"""An OpenAI-compatible server in a subprocess on 127.0.0.1: the one way the server tests,
the entry-point kit and the benchmarks start a server (servelab's, or vLLM's to compare)."""

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


def servelab_argv(port: int, overrides: Sequence[str], command: Sequence[str] = MODULE_COMMAND) -> list[str]:
    """``servelab-serve`` (``command``) on ``port`` without an access log, with the Hydra
    ``overrides`` last."""
    return [*command, f"server.port={port}", "server.access_log=false", *overrides]


class ServerProcess:
    """``argv`` in a subprocess, listening on 127.0.0.1:``port`` and logging to
    ``log_path``; ``env``: variables added to this process's. The constructor returns once
    ``/health`` answers (raising ``RuntimeError`` with the log's end if the server exits or
    does not answer within ``startup_timeout_s``). ``stop`` sends SIGTERM and returns the
    exit status."""

    def __init__(self, argv: Sequence[str], port: int, log_path: Path | str, env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        self._wait_ready(startup_timeout_s)

    @classmethod
    def servelab(cls, log_path: Path | str, *overrides: str, command: Sequence[str] = MODULE_COMMAND,
                 port: int | None = None, env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        """``servelab-serve`` with the Hydra ``overrides`` on ``port`` (default: a free one)."""
        port = free_port() if port is None else port
        return cls(servelab_argv(port, overrides, command), port, log_path, env, startup_timeout_s)

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
