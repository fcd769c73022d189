"""The server tests' ``servelab-serve``: ``servelab.testing.server_process`` on the small
``model=toy`` engine they share."""

from __future__ import annotations

import sys
from pathlib import Path

from servelab.platform import free_port
from servelab.testing.server_process import MODULE_COMMAND, servelab_argv
from servelab.testing.server_process import ServerProcess as SubprocessServer

API_KEY = "test-key"
MODEL = "toy"
ENGINE_OVERRIDES = ["model=toy", "cache.num_blocks=256"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def console_script(name: str) -> str:
    """The installed console script ``name`` of this environment (``servelab-serve``)."""
    return str(Path(sys.executable).with_name(name))


class ServerProcess(SubprocessServer):
    """A server of ``engine`` (default: the shared ``model=toy`` engine) with the test's
    ``overrides``; ``command``: what to run instead of ``python -m servelab.server``."""

    def __init__(self, log_path: Path, *overrides: str, engine: tuple[str, ...] = tuple(ENGINE_OVERRIDES),
                 command: tuple[str, ...] = MODULE_COMMAND):
        port = free_port()
        super().__init__(servelab_argv(port, [*engine, *overrides], command), port, log_path, ONE_THREAD)
