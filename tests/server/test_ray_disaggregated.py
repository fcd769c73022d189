"""``servelab-serve server.backend=ray deployment=disaggregated`` on a local Ray cluster:
the prefill and decode engines run as Ray actors, their KV caches move over
``kv_transfer=torch_distributed``, and the server answers as one mixed engine does.

Needs the ``ray`` extra (``pip install -e ".[test,ray]"``); skipped without it.
"""

from __future__ import annotations

import httpx
import pytest
from server_process import MODEL, ServerProcess
from test_disaggregated_server import complete_concurrently
from test_openai_client import PROMPTS

from servelab.platform import free_port

pytest.importorskip("ray")


def test_instances_as_ray_actors_answer_as_one_engine(tmp_path, greedy):
    server = ServerProcess(tmp_path / "server.log", "server.backend=ray", "deployment=disaggregated",
                           "server.replica_cpus=1", "kv_transfer=torch_distributed", f"kv_transfer.port={free_port()}")
    try:
        assert complete_concurrently(server.url, PROMPTS, 12) == [text for text, _, _ in greedy(PROMPTS, 12)]
        with httpx.Client(base_url=server.url, timeout=120) as client:
            streamed = client.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True})
            text = "".join(line for line in streamed.text.splitlines() if line.startswith("data: {"))
            assert '"finish_reason":"length"' in text
    finally:
        assert server.stop() == 0, server.log()[-3000:]
