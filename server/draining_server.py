"""A uvicorn server whose SIGTERM drains the engine first and then exits with status 0, and
which shuts down with status 1 when the engine fails."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from servelab.server.state import ServerState

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM or SIGINT: answer new requests with 503, let in-flight ones
    finish for up to ``server.drain_timeout_s``, abort the rest, then run uvicorn's
    graceful shutdown (the lifespan stops the engine process). A second signal exits at
    once. Unlike plain uvicorn, the signal is not re-raised afterwards, so the process
    exits with status 0. When the engine fails (its loop raised, its process or a parallel
    worker died), requests in flight get 503, new ones too, and the server shuts down with
    ``exit_code`` 1 so that a supervisor restarts it.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set before the signal handlers
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        """Serve until drained or the engine fails (see the class docstring)."""
        self._loop = asyncio.get_running_loop()
        self.state.engine.on_failed = self._engine_failed
        await super().serve(sockets)

    def _engine_failed(self, reason: str) -> None:
        log.error("shutting down: the engine failed (%s)", reason)
        self.state.draining = True
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: start draining, or exit now on a second signal."""
        if self.state.draining:
            self.should_exit = self.force_exit = True
            return
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self._drain = self._loop.create_task(self._drain_then_exit(signal_name))

    async def _drain_then_exit(self, signal_name: str) -> None:
        timeout = self.state.config.drain_timeout_s
        log.info("received %s: draining (up to %.1fs), new requests get 503", signal_name, timeout)
        await self.state.drain(timeout)
        self.should_exit = True
