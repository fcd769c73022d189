"""SIGTERM: new requests get 503, in-flight ones finish within the drain timeout, the rest
are aborted, and the process exits 0 leaving no child (engine process included) behind;
a tensor-parallel engine process stops its workers before it exits."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from server_process import ENGINE_OVERRIDES, ServerProcess

from servelab.testing.lifecycle import descendant_pids, is_alive


def _children(pid: int) -> set[int]:
    children = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        children |= {int(c) for c in (task / "children").read_text().split()}
    return children


def _stream(url: str, body: dict, started: threading.Event) -> list[str]:
    """The data lines of a streamed completion; sets ``started`` at the first one."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
    return lines


def test_sigterm_drains_then_exits_zero(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "server.drain_timeout_s=2",
                           "model.shape.max_position_embeddings=4096")
    try:
        short = {"prompt": "short", "max_tokens": 16, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}
        long = {"prompt": "long", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        started = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as pool:
            long_lines = pool.submit(_stream, server.url, long, started[0])
            assert started[0].wait(60)
            short_lines = pool.submit(_stream, server.url, short, started[1])
            assert started[1].wait(60)
            children = _children(server.process.pid)
            server.process.send_signal(signal.SIGTERM)

            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
            assert httpx.get(f"{server.url}/health").status_code == 503

            short_chunks = [json.loads(line) for line in short_lines.result()[:-1]]
            assert [c["choices"][0]["finish_reason"] for c in short_chunks if c["choices"]][-1] == "length"
            assert short_chunks[-1]["usage"]["completion_tokens"] == 16

            *tokens, last, done = long_lines.result()
            assert done == "[DONE]" and json.loads(last)["error"]["code"] == "service_unavailable"
            assert all(json.loads(t)["choices"][0]["finish_reason"] is None for t in tokens)
        assert server.process.wait(60) == 0
        assert "draining" in server.log() and "Traceback" not in server.log()
        deadline = time.monotonic() + 10  # helper processes see the pipe close, then exit
        while [pid for pid in children if os.path.exists(f"/proc/{pid}")] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    finally:
        server.stop()


def test_sigterm_stops_a_tensor_parallel_engine_and_its_workers(tmp_path):
    server = ServerProcess(tmp_path / "server.log", engine=(*ENGINE_OVERRIDES, "parallel.tensor_parallel_size=2"))
    try:
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200, reply.text
        engine_and_worker = descendant_pids(server.process.pid)
        assert len(engine_and_worker) >= 2, engine_and_worker
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(map(is_alive, engine_and_worker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(is_alive, engine_and_worker))
        assert "parallel workers stopped (exit codes 0)" in server.log(), server.log()[-3000:]
        assert "Traceback" not in server.log()
    finally:
        server.stop()
