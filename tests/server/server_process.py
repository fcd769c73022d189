"""A ``servelab-serve`` subprocess on 127.0.0.1 for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "toy"
ENGINE_OVERRIDES = ["model=toy", "cache.num_blocks=256"]
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str) -> str:
    """The installed console script ``name`` of this environment (``servelab-serve``)."""
    return str(Path(sys.executable).with_name(name))


class ServerProcess:
    """``python -m servelab.server`` in a subprocess, logging to a file. ``engine``: the
    engine overrides (default: the small ``model=toy`` engine the server tests share);
    ``command``: what to run instead of ``python -m servelab.server``."""

    def __init__(self, log_path: Path, *overrides: str, engine: tuple[str, ...] = tuple(ENGINE_OVERRIDES),
                 command: tuple[str, ...] = (sys.executable, "-m", "servelab.server")):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [*engine, f"server.port={self.port}", "server.access_log=false", *overrides]
        self._log = open(log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([*command, *args], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, wait, and return the exit status (SIGKILL after 60 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
