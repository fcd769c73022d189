"""``target=http``: any OpenAI-compatible server, measured through streaming completions."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Sequence

from omegaconf import DictConfig

from servelab.bench.metrics import RequestRecord
from servelab.bench.system import FollowUp, System
from servelab.bench.targets.sse import sse_data

DEADLINE_EXCEEDED = "deadline_exceeded"
"""The error code of a request the server's deadline policy refused."""
from servelab.bench.workload import BenchRequest, model_token_space
from servelab.core.errors import ConfigError


class HttpSystem(System):
    """Sends each request at its arrival offset as a streaming ``POST`` with token-id
    prompts (``prompt: [ids]``, ``max_tokens``, ``ignore_eos``,
    ``stream_options.include_usage``) and times every streamed chunk.

    TTFT and gaps come from chunk arrival times; a chunk that only carries
    ``finish_reason`` is not a token. The output length is the server's
    ``usage.completion_tokens`` when reported, else the number of chunks. The output
    token ids (``RequestRecord.output_token_ids``, which closed-loop workloads feed back)
    are the streamed text re-tokenized: an OpenAI stream carries text, not ids, so they can
    differ from the server's where the tokenizer would split the text otherwise.
    """

    name = "http"
    closed_loop = True

    def __init__(self, cfg: DictConfig):
        self.target = cfg.target
        self.workload = cfg.workload
        self.space = model_token_space(cfg.model)
        self.url = self.target.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {self.target.api_key}"} if self.target.api_key else {}

    def run(self, requests: Sequence[BenchRequest], progress: Any = None,
            follow_up: FollowUp | None = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Send every request at its offset and wait for all; with ``follow_up`` (closed
        loop), each finished stream's next request too. No server-side statistics."""
        return asyncio.run(self._run_all(requests, progress, follow_up)), {}

    async def _run_all(self, requests: Sequence[BenchRequest], progress: Any,
                       follow_up: FollowUp | None) -> list[RequestRecord]:
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request

        limits = httpx.Limits(max_connections=self.target.max_connections,
                              max_keepalive_connections=self.target.max_connections)
        async with httpx.AsyncClient(timeout=self.target.timeout_s, limits=limits, headers=self.headers) as client:
            model = self.target.model or await self._first_model(client)
            start = time.perf_counter()

            async def chain(request: BenchRequest | None) -> list[RequestRecord]:
                records = []
                while request is not None:
                    await asyncio.sleep(max(0.0, start + request.arrival_offset_s - time.perf_counter()))
                    records.append(await self._send(client, model, request))
                    if progress is not None:
                        progress.update(1)
                    request = follow_up(records[-1]) if follow_up is not None else None
                return records

            return [record for records in await asyncio.gather(*(chain(r) for r in requests)) for record in records]

    async def _first_model(self, client: Any) -> str:
        import httpx

        try:
            response = await client.get(f"{self.url}/v1/models")
            response.raise_for_status()
            models = response.json().get("data") or []
        except (httpx.HTTPError, ValueError) as exc:
            raise ConfigError([f"target.url={self.url!r}: cannot list models ({type(exc).__name__}: {exc}); "
                               f"is the server running? (or set target.model)"]) from exc
        if not models:
            raise ConfigError([f"{self.url}/v1/models lists no model; set target.model"])
        return models[0]["id"]

    def _payload(self, model: str, request: BenchRequest) -> dict[str, Any]:
        """The streamed completion request (a LoRA request names its adapter as the
        ``model``); a tenant's request also carries its ``user``, ``priority`` and
        ``slo_class`` (servelab's scheduling fields)."""
        payload = {"model": request.lora or model, "prompt": list(request.prompt_token_ids),
                   "max_tokens": request.max_tokens,
                   "temperature": self.workload.temperature, "ignore_eos": self.workload.ignore_eos,
                   "stream": True, "stream_options": {"include_usage": True}}
        metadata = request.metadata
        if metadata is not None:
            payload.update({"user": metadata.tenant, "priority": metadata.priority, "slo_class": metadata.slo_class})
        return payload

    async def _send(self, client: Any, model: str, request: BenchRequest) -> RequestRecord:
        import httpx

        times: list[float] = []
        text: list[str] = []
        completion_tokens = None
        sent = time.perf_counter()
        try:
            async with client.stream("POST", self.url + self.target.endpoint, json=self._payload(model, request)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    return self._failed(request, sent, f"HTTP {response.status_code}: {body[:200]}",
                                        refused=DEADLINE_EXCEEDED in body)
                async for data in sse_data(response.aiter_lines()):
                    if data.strip() == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return self._failed(request, sent, f"stream error: {json.dumps(chunk['error'])[:200]}",
                                            refused=chunk["error"].get("code") == DEADLINE_EXCEEDED)
                    for choice in chunk.get("choices") or []:
                        if choice.get("text") or choice.get("finish_reason") is None:
                            times.append(now)
                        text.append(choice.get("text") or "")
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        completion_tokens = usage["completion_tokens"]
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return self._failed(request, sent, f"{type(exc).__name__}: {exc}")
        if not times:
            return self._failed(request, sent, "the stream carried no tokens")
        tokenizer = self.space.tokenizer
        output_ids = None if tokenizer is None else tuple(tokenizer.encode("".join(text), add_special_tokens=False))
        return RequestRecord(request.request_id, sent, tuple(times), len(request.prompt_token_ids),
                             completion_tokens if completion_tokens is not None else len(times),
                             output_token_ids=output_ids)

    @staticmethod
    def _failed(request: BenchRequest, sent: float, error: str, refused: bool = False) -> RequestRecord:
        """A request that got no tokens; ``refused``: the server's deadline policy refused it
        (finish reason ``deadline``, counted as a missed SLO rather than a failure)."""
        return RequestRecord(request.request_id, sent, (), len(request.prompt_token_ids), 0, error=error,
                             finish_reason="deadline" if refused else None)
