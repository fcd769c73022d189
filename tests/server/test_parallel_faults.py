"""``servelab-serve`` over a tensor-parallel engine whose worker dies: requests in flight
and new ones get 503, the server exits non-zero, and no engine or worker process is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
from server_process import ENGINE_OVERRIDES, ServerProcess


def spawned_children(pid: int) -> list[int]:
    """The child processes of ``pid`` that servelab started (the engine process, by
    multiprocessing's spawn; the parallel workers; not multiprocessing's resource
    tracker), from Linux ``/proc``."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    markers = (b"spawn_main", b"servelab.plugins.executor.worker_main")
    return [child for child in found if any(m in Path(f"/proc/{child}/cmdline").read_bytes() for m in markers)]


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dead_worker_answers_503_and_stops_the_server(tmp_path):
    server = ServerProcess(tmp_path / "server.log", engine=(*ENGINE_OVERRIDES, "parallel.tensor_parallel_size=2"))
    try:
        (engine,) = spawned_children(server.process.pid)
        (worker,) = spawned_children(engine)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={
                    "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(worker, signal.SIGKILL)
                rest = "\n".join(lines)
            assert "a parallel worker exited: rank 1" in rest and "engine_dead" in rest, rest[-2000:]
            try:
                late = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert late.status_code == 503, late.text
            except httpx.TransportError:  # already shut down
                pass
        assert server.process.wait(60) == 1, server.log()
        deadline = time.monotonic() + 30
        while (alive(engine) or alive(worker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(engine) and not alive(worker)
    finally:
        server.stop()
