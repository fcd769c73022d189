"""An HTTP request carried to an engine replica and replayed on its FastAPI app.

With ``server.backend=ray`` the ingress reads each request and hands it to a replica
through a Ray Serve handle; the replica runs it through the same servelab app that
``servelab-serve`` serves locally (``app.create_app``), in-process over ASGI, and streams
back what the app sends. No endpoint is written twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request as the ingress received it. ``headers``: raw ASGI pairs
    (lower-case names); ``prompt_token_ids``: the prompt a servelab router routes by
    (``server.routing=router``), None otherwise or when the body has no prompt."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prompt_token_ids: tuple[int, ...] | None = None

    def scope(self) -> dict[str, Any]:
        """The ASGI HTTP scope of this request."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "root_path": "", "query_string": self.query_string, "headers": list(self.headers),
                "client": None, "server": None, "state": {}}


async def replay(app: Callable, request: ForwardedRequest) -> AsyncIterator[Message]:
    """Run ``request`` through the ASGI ``app`` and yield what it sends: one
    ``http.response.start``, then ``http.response.body`` messages. Closing the generator
    early (the client went away) tells the app the client disconnected and cancels it,
    which aborts the request's engine work."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        complete = False
        while not complete and (message := await sent.get()) is not None:
            yield message
            complete = message["type"] == "http.response.body" and not message.get("more_body", False)
        if not complete:
            await task  # the app ended without a whole response: raise its error
    finally:
        gone.set()
        task.cancel()
