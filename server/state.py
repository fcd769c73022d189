"""What the server's request handlers share (``ServerState``)."""

from __future__ import annotations

import logging
import time

from servelab.server.async_engine import AsyncEngine
from servelab.server.config import ServerConfig
from servelab.server.errors import RequestAbortedError

log = logging.getLogger(__name__)


class ServerState:
    """What the handlers share: the engine (which admits and streams their calls), the
    server settings, the served model name, and whether the server is draining (then new
    requests get 503)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_name: str):
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.draining = False
        self.created = int(time.time())

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give in-flight ones ``timeout`` seconds, abort the rest."""
        self.draining = True
        if not await self.engine.wait_idle(timeout):
            log.warning("drain timeout (%.1fs): aborting %d requests", timeout, self.engine.num_in_flight)
            self.engine.abort_all(RequestAbortedError())
