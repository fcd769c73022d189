"""``target=http`` against a fake OpenAI-compatible SSE server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from servelab.bench.runner import measure, open_system
from servelab.bench.targets.sse import sse_data
from servelab.checkpoints.toy import byte_level_tokenizer

FIRST_TOKEN_S = 0.05
GAP_S = 0.02


class FakeCompletions(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-token chunks: the first after 50 ms, then every 20 ms,
    then a finish chunk, a usage chunk and ``[DONE]``; a request of ``slo_class: tight``
    gets the error event of a deadline refusal instead."""

    requests: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._json(404, {"error": "no such endpoint"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeCompletions.requests.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(payload) -> None:
            self.wfile.write(f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        if body.get("slo_class") == "tight":
            event({"error": {"message": "refused", "type": "server_error", "param": "deadline",
                             "code": "deadline_exceeded"}})
            event("[DONE]")
            return
        for i in range(body["max_tokens"]):
            time.sleep(FIRST_TOKEN_S if i == 0 else GAP_S)
            event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
        event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}})
        event("[DONE]")


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_target_times_streamed_chunks(bench_config, server_url, tmp_path):
    FakeCompletions.requests.clear()
    cfg = bench_config("target=http", f"target.url={server_url}", "workload.num_requests=6",
                       "workload.output_range=[4,6]", "workload.arrival=poisson", "workload.rate=50",
                       "warmup_requests=1")
    system = open_system(cfg, str(tmp_path))
    metrics = measure(system, cfg)
    assert metrics["num_completed"] == 6 and metrics["num_failed"] == 0
    assert metrics["system"] == {"name": "http"}
    sent = FakeCompletions.requests
    assert len(sent) == 7 and sent[0]["max_tokens"] == 4  # the warmup request first
    for body in sent:
        assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
        assert all(isinstance(t, int) for t in body["prompt"]) and body["stream_options"] == {"include_usage": True}
    assert metrics["ttft_ms"]["p50"] >= 1000 * FIRST_TOKEN_S * 0.9
    assert 1000 * GAP_S * 0.75 <= metrics["itl_ms"]["p50"] < 1000 * GAP_S * 10
    assert metrics["mean_output_tokens"] == pytest.approx(sum(b["max_tokens"] for b in sent[1:]) / 6)
    # One gap per token after the first: the finish-only chunk is not a token.
    assert len(metrics["samples"]["itl_ms"]) == sum(b["max_tokens"] - 1 for b in sent[1:])


def test_http_errors_become_failed_records(bench_config, server_url, tmp_path):
    cfg = bench_config("target=http", f"target.url={server_url}", "target.endpoint=/v1/missing",
                       "target.model=m", "workload.num_requests=2", "warmup_requests=0")
    metrics = measure(open_system(cfg, str(tmp_path)), cfg)
    assert metrics["num_failed"] == 2 and metrics["num_completed"] == 0
    assert metrics["errors"][0].startswith("HTTP 404")


def test_sse_parser_joins_data_lines_and_skips_comments():
    async def lines():
        for line in [": keep-alive", "data: {\"a\":", "data: 1}", "", "event: x", "data:[DONE]", "", "data: tail"]:
            yield line

    async def collect():
        return [d async for d in sse_data(lines())]

    assert asyncio.run(collect()) == ['{"a":\n1}', "[DONE]", "tail"]


def test_http_target_sends_tenant_fields_and_counts_refusals(bench_config, server_url, tmp_path):
    FakeCompletions.requests.clear()
    cfg = bench_config("target=http", f"target.url={server_url}", "workload.num_requests=8",
                       "workload.output_range=[2,3]", "workload.arrival=poisson", "warmup_requests=0",
                       "+workload.tenants.alice={rate:40,priority:-1}", "+workload.tenants.bob={rate:40,slo_class:tight}")
    metrics = measure(open_system(cfg, str(tmp_path)), cfg)
    sent = {(body["user"], body["priority"], body["slo_class"]) for body in FakeCompletions.requests}
    assert sent == {("alice", -1, None), ("bob", 0, "tight")}
    tenants = metrics["tenants"]
    assert tenants["bob"]["refused"] == tenants["bob"]["requests"] > 0
    assert tenants["alice"]["refused"] == 0


def test_http_target_runs_conversations_closed_loop(bench_config, server_url, tmp_path):
    """Each next turn is sent after the previous stream ended, with its text (re-tokenized)."""
    FakeCompletions.requests.clear()
    cfg = bench_config("target=http", f"target.url={server_url}", "workload=multi_turn", "warmup_requests=0",
                       "workload.multi_turn.conversations=2", "workload.multi_turn.turns=[3,3]",
                       "workload.multi_turn.think_time=fixed", "workload.multi_turn.think_time_s=0.05",
                       "workload.lengths=uniform", "workload.input_range=[4,8]", "workload.output_range=[2,3]",
                       "workload.rate=50")
    metrics = measure(open_system(cfg, str(tmp_path)), cfg)
    assert metrics["num_completed"] == 6 and metrics["sessions"]["later_turns"]["num_requests"] == 4
    prompts = [body["prompt"] for body in FakeCompletions.requests]
    x = byte_level_tokenizer().encode("x", add_special_tokens=False)
    for prompt in prompts:
        shorter = [p for p in prompts if len(p) < len(prompt) and prompt[:len(p)] == p]
        if shorter:  # a later turn: the previous prompt, its answer ("x" per token), a new message
            previous = max(shorter, key=len)
            answer = FakeCompletions.requests[prompts.index(previous)]["max_tokens"]
            assert prompt[len(previous):len(previous) + answer] == x * answer
    assert sum(1 for prompt in prompts if any(len(p) < len(prompt) and prompt[:len(p)] == p for p in prompts)) == 4
