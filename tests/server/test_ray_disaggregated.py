"""``servelab-serve server.backend=ray deployment=disaggregated`` on a local Ray cluster:
the prefill and decode engines run as Ray actors, their KV caches move over
``kv_transfer=torch_distributed``, and the server answers as one mixed engine does.

Needs the ``ray`` extra (``pip install -e ".[test,ray]"``); skipped without it.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from server_process import MODEL, ServerProcess
from test_openai_client import PROMPTS

from servelab.platform import free_port

pytest.importorskip("ray")


def test_instances_as_ray_actors_answer_as_one_engine(tmp_path, greedy):
    server = ServerProcess(tmp_path / "server.log", "server.backend=ray", "deployment=disaggregated",
                           "server.replica_cpus=1", "kv_transfer=torch_distributed", f"kv_transfer.port={free_port()}")
    try:
        expected = greedy(PROMPTS, 12)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            def complete(prompt: str) -> str:
                response = client.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["text"]

            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                assert list(pool.map(complete, PROMPTS)) == [text for text, _, _ in expected]
            streamed = client.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True})
            text = "".join(line for line in streamed.text.splitlines() if line.startswith("data: {"))
            assert '"finish_reason":"length"' in text
    finally:
        assert server.stop() == 0, server.log()[-3000:]
