"""The engine thread in process: a failing engine fails its requests instead of hanging."""

from __future__ import annotations

import json

import asyncio
import time

import pytest

from servelab import SamplingParams
from servelab.server.async_engine import AsyncEngine
from servelab.server.errors import EngineDeadError
from servelab.server.metrics import ServerMetrics


def test_engine_failure_fails_requests_and_later_calls(offline, monkeypatch):
    engine = offline.engine

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken_step)

    async def run() -> None:
        async_engine = AsyncEngine(engine, ServerMetrics(engine))
        async_engine.start()
        async with async_engine.open_stream() as stream:
            await stream.add("hi", SamplingParams(max_tokens=2), "doomed", time.perf_counter())
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in stream:
                    pass
        assert async_engine.dead is not None
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda e: e.max_model_len)
        await async_engine.stop()

    asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert not engine.has_unfinished_requests()


def test_sse_events_survive_line_separators_in_text():
    from servelab.server.streaming import sse

    event = sse({"text": "a\u2028b\x85c\u2029d\x1ce\r\nf é"})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):]) == {"text": "a\u2028b\x85c\u2029d\x1ce\r\nf é"}
