"""The engine process and its loop: a failing or dying engine fails its requests instead
of hanging them."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
import threading
import time

import pytest
from server_process import ENGINE_OVERRIDES

from servelab import LLM, SamplingParams
from servelab.core.errors import ConfigError
from servelab.core.request_metadata import RequestMetadata
from servelab.server.async_engine import AsyncEngine
from servelab.server.config import compose_serve_config
from servelab.server.engine_loop import EngineLoop
from servelab.server.engine_process import MAX_NICE, EngineProcess
from servelab.server.errors import EngineDeadError
from servelab.server.messages import AbortRequests, AddRequest, EngineFailed, RequestAdded, StepReport, StopEngine
from servelab.server.metrics import ServerMetrics


@pytest.fixture
def served():
    """An engine of its own for a loop to serve (the loop shuts it down when it stops)."""
    return LLM("toy", overrides=ENGINE_OVERRIDES[1:])


def test_failing_step_is_reported_once_then_adds_are_refused(served, monkeypatch):
    engine = served.engine

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken_step)
    server_end, engine_end = multiprocessing.Pipe()
    loop = threading.Thread(target=EngineLoop(engine, engine_end).run)
    loop.start()
    server_end.send(AddRequest("doomed", "hi", SamplingParams(max_tokens=2), time.perf_counter()))
    assert server_end.recv() == RequestAdded("doomed", 2)
    failed = server_end.recv()
    assert isinstance(failed, EngineFailed) and "boom" in failed.description
    server_end.send(AddRequest("late", "hi", SamplingParams(max_tokens=2), time.perf_counter()))
    added = server_end.recv()
    assert isinstance(added, RequestAdded) and added.request_id == "late" and "boom" in str(added.error)
    server_end.send(StopEngine())
    loop.join(timeout=30)
    assert not loop.is_alive()
    assert not engine.has_unfinished_requests()


def test_bad_request_is_refused_by_name_and_loop_keeps_serving(served):
    server_end, engine_end = multiprocessing.Pipe()
    loop = threading.Thread(target=EngineLoop(served.engine, engine_end).run)
    loop.start()
    server_end.send(AddRequest("long", "hi", SamplingParams(max_tokens=10**6), time.perf_counter()))
    error = server_end.recv().error
    assert error.field == "max_tokens" and "maximum context length" in str(error)
    server_end.send(AddRequest("fine", "hi", SamplingParams(max_tokens=2, temperature=0), time.perf_counter()))
    assert server_end.recv() == RequestAdded("fine", 2)
    tokens = []
    while True:
        report = server_end.recv()
        assert isinstance(report, StepReport)
        tokens += [t for o in report.outputs for c in o.outputs for t in c.token_ids]
        if any(o.finished for o in report.outputs):
            break
    assert len(tokens) == 2
    server_end.send(StopEngine())
    loop.join(timeout=30)
    assert not loop.is_alive()


def test_request_metadata_reaches_the_engine(served):
    engine = served.engine
    server_end, engine_end = multiprocessing.Pipe()
    loop = threading.Thread(target=EngineLoop(engine, engine_end).run)
    loop.start()
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    server_end.send(AddRequest("unknown", "hi", params, time.perf_counter(), RequestMetadata(slo_class="gold")))
    assert server_end.recv().error.field == "slo_class"
    metadata = RequestMetadata(priority=-3, tenant="acme", deadline=time.time() + 3600)
    server_end.send(AddRequest("tagged", "hi", params, time.perf_counter(), metadata))
    assert server_end.recv() == RequestAdded("tagged", 2)
    assert engine.outputs.groups["tagged"].children[0].metadata == metadata
    server_end.send(AbortRequests(("tagged",)))
    while "tagged" not in server_end.recv().aborted:
        pass
    server_end.send(StopEngine())
    loop.join(timeout=30)
    assert not loop.is_alive()


@pytest.mark.parametrize("override, field", [("server.engine_threads=0", "server.engine_threads"),
                                             ("server.warmup_tokens=-1", "server.warmup_tokens"),
                                             ("server.engine_nice=-1", "server.engine_nice"),
                                             ("server.engine_nice=20", "server.engine_nice")])
def test_bad_engine_process_settings_name_the_field(override, field):
    cfg = compose_serve_config([*ENGINE_OVERRIDES, override])
    with pytest.raises(ConfigError, match=field):
        EngineProcess.launch(cfg)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads of /proc/<pid>/task")
def test_engine_threads_run_below_the_http_side_priority():
    cfg = compose_serve_config([*ENGINE_OVERRIDES, "server.engine_threads=2", "server.engine_nice=7"])
    process = EngineProcess.launch(cfg)  # its warm-up has run matmuls on both compute threads
    try:
        tasks = os.listdir(f"/proc/{process.process.pid}/task")
        priorities = {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in tasks}
    finally:
        process.conn.send(StopEngine())
        process.join()
    assert len(tasks) >= 2
    assert priorities == {min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, 0) + 7)}


def test_dead_engine_process_fails_requests_and_later_calls():
    cfg = compose_serve_config([*ENGINE_OVERRIDES, "server.engine_threads=1", "server.warmup_tokens=0"])
    process = EngineProcess.launch(cfg)

    async def run() -> None:
        async_engine = AsyncEngine(process, ServerMetrics())
        async_engine.start()
        assert await async_engine.call(lambda e: e.max_model_len) == process.info.max_model_len
        async with async_engine.open_stream() as stream:
            await async_engine.add(stream, "hi", SamplingParams(max_tokens=400, ignore_eos=True), "doomed",
                                   time.perf_counter())
            process.process.kill()
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in stream:
                    pass
        assert async_engine.dead is not None
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda e: e.max_model_len)
        await async_engine.stop()

    asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert process.exitcode is not None


def test_sse_events_survive_line_separators_in_text():
    from servelab.server.output_stream import sse

    event = sse({"text": "a\u2028b\x85c\u2029d\x1ce\r\nf é"})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):]) == {"text": "a\u2028b\x85c\u2029d\x1ce\r\nf é"}


def test_step_reports_carry_cache_events_for_a_kv_aware_router():
    from servelab.core.kv_cache import block_hashes

    llm = LLM("toy", overrides=[*ENGINE_OVERRIDES[1:], "router=kv_aware", "cache.enable_prefix_caching=true",
                                "cache.block_size=4"])
    server_end, engine_end = multiprocessing.Pipe()
    loop = threading.Thread(target=EngineLoop(llm.engine, engine_end).run)
    loop.start()
    prompt = list(range(3, 15))
    server_end.send(AddRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=3), time.perf_counter()))
    stored, finished = set(), False
    while not finished:
        message = server_end.recv()
        if isinstance(message, StepReport):
            stored.update(h for event in message.cache_events if event.kind == "stored" for h in event.hashes)
            finished = any(output.finished for output in message.outputs)
    server_end.send(StopEngine())
    loop.join(timeout=30)
    assert set(block_hashes(prompt, 4, 3)) <= stored
