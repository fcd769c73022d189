"""The parts of ``server.backend=ray`` that need no Ray: the backend settings' errors, the
replicas' merged metrics, the prompt a router sees, and replaying a request on an app."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from servelab.server.config import compose_serve_config, server_problems
from servelab.server.ray_serve.forwarded_request import ForwardedRequest, replay
from servelab.server.metrics import ServerMetrics
from servelab.server.ray_serve.replica_metrics import label_replicas
from servelab.server.ray_serve.routing_prompt import routing_prompt


@pytest.mark.parametrize("overrides, expected", [
    (["server.backend=foo"], "server.backend must be one of local, ray, got 'foo'"),
    (["server.backend=ray", "server.replicas=0"], "server.replicas must be >= 1, got 0"),
    (["server.replicas=2"], "server.replicas=2 needs server.backend=ray"),
    (["server.backend=ray", "server.routing=nearest"], "server.routing must be one of ray, router, got 'nearest'"),
    (["server.backend=ray", "server.replica_cpus=-1"], "server.replica_cpus and server.replica_gpus must be >= 0"),
])
def test_backend_settings_errors_name_the_field(overrides, expected):
    problems = server_problems(compose_serve_config(["model=toy", *overrides]).server)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_defaults_are_the_local_server():
    server = compose_serve_config(["model=toy"]).server
    assert (server.backend, server.replicas, server.routing, server_problems(server)) == ("local", 1, "ray", [])


def test_serve_exits_2_naming_the_field():
    result = subprocess.run([sys.executable, "-m", "servelab.server", "model=toy", "server.backend=ray",
                             "server.replicas=0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "server.replicas must be >= 1, got 0" in result.stderr


def test_a_replicas_config_error_is_read_from_its_traceback():
    from servelab.core.errors import ConfigError
    from servelab.server.ray_serve.app import config_problems

    error = ConfigError(["cache.block_size must be >= 1, got 0", "scheduler.max_num_seqs must be >= 1, got 0"])
    message = f"Traceback (most recent call last):\n  File \"x.py\"\nservelab.core.errors.ConfigError: {error}\n"
    assert config_problems(message) == error.problems
    assert config_problems("RuntimeError: boom") == []


def test_replicas_metrics_carry_a_replica_label():
    first, second = ServerMetrics(), ServerMetrics()
    first.generation_tokens.labels(tenant="default").inc(3)
    second.generation_tokens.labels(tenant="default").inc(4)
    first.ttft.labels(tenant="default")
    second.ttft.labels(tenant="default").observe(0.05)
    merged = label_replicas({"a": first.render(), "b": second.render()}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    tokens = {s.labels["replica"]: s.value for s in families["servelab:generation_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens == {"a": 3.0, "b": 4.0}
    counts = {s.labels["replica"]: s.value for s in families["servelab:time_to_first_token_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 0.0, "b": 1.0}
    assert merged.count("# TYPE servelab:generation_tokens_total counter") == 1


def test_routing_prompt_is_what_the_engine_sees():
    from servelab.checkpoints.toy import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    text = routing_prompt("/v1/completions", b'{"prompt": ["abc", "xyz"]}', tokenizer)
    assert text == tuple(tokenizer.encode("abc", add_special_tokens=False))
    assert routing_prompt("/v1/completions", b'{"prompt": [5, 6, 7]}', tokenizer) == (5, 6, 7)
    chat = routing_prompt("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi!"}]}', tokenizer)
    assert chat == tuple(tokenizer.encode("<|user|>\nHi!\n<|assistant|>\n", add_special_tokens=False))
    assert routing_prompt("/v1/completions", b'{"prompt": "x", "bogus": 1}', tokenizer) is None
    assert routing_prompt("/health", b"", tokenizer) is None


def _app(cancelled: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"body": (await request.body()).decode(), "query": request.url.query,
                "header": request.headers.get("x-test")}

    @app.get("/forever")
    async def forever() -> StreamingResponse:
        async def chunks():
            try:
                yield "first"
                await asyncio.sleep(60)
            finally:
                cancelled.set()
        return StreamingResponse(chunks())

    return app


def test_replay_runs_a_request_through_the_app():
    async def run() -> list[dict]:
        request = ForwardedRequest("POST", "/echo", b"a=1", ((b"x-test", b"yes"),), b"payload")
        return [message async for message in replay(_app(asyncio.Event()), request)]

    start, body = asyncio.run(run())
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert body["body"] == b'{"body":"payload","query":"a=1","header":"yes"}'


def test_closing_a_replay_cancels_the_app():
    async def run() -> bool:
        cancelled = asyncio.Event()
        messages = replay(_app(cancelled), ForwardedRequest("GET", "/forever", b"", (), b""))
        assert (await messages.__anext__())["type"] == "http.response.start"
        assert (await messages.__anext__())["body"] == b"first"
        await messages.aclose()
        await asyncio.wait_for(cancelled.wait(), 5)
        return cancelled.is_set()

    assert asyncio.run(run())
