"""``POST /v1/chat/completions``: chat completion, streamed or not."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request

from servelab.server.chat_template import render_chat
from servelab.server.choices import ChoiceDelta, ChoiceTracker
from servelab.server.errors import stream_error
from servelab.server.logprobs import chat_logprobs
from servelab.server.output_stream import DONE, EventStreamResponse, OutputStream, sse, until_disconnected
from servelab.server.protocol import TENANT_HEADER, ChatCompletionRequest

if TYPE_CHECKING:
    from servelab.server.state import ServerState


class ChatResponder:
    """Builds the response of one chat completion request from its engine outputs."""

    def __init__(self, body: ChatCompletionRequest, model: str, tracker: ChoiceTracker):
        self.body = body
        self.tracker = tracker
        self.header = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}

    def _logprobs(self, token_ids: list[int], entries: list | None) -> dict | None:
        if entries is None or not self.body.logprobs:
            return None
        return chat_logprobs(token_ids, entries, self.body.top_logprobs or 0)

    def _chunk(self, choices: list[dict], **extra: object) -> str:
        return sse({**self.header, "object": "chat.completion.chunk", "choices": choices, **extra})

    def _delta_choice(self, delta: ChoiceDelta) -> dict:
        return {"index": delta.index, "delta": {"content": delta.text},
                "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        """The SSE chunks: the role first for every choice, then one per content delta
        (the last of each choice carries ``finish_reason``), a usage chunk when asked,
        ``[DONE]``."""
        async with stream:
            try:
                for index in range(self.tracker.num_choices):
                    yield self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
                async for output in stream:
                    for delta in self.tracker.update(output):
                        if delta.worth_sending():
                            yield self._chunk([self._delta_choice(delta)])
                if self.body.include_usage:
                    yield self._chunk([], usage=self.tracker.usage())
            except Exception as exc:
                yield sse(stream_error(exc))
        yield DONE

    async def whole(self, stream: OutputStream) -> dict:
        """The non-streamed response, once every choice finished."""
        async with stream:
            async for output in stream:
                self.tracker.update(output)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in self.tracker.collected()]
        return {**self.header, "object": "chat.completion", "choices": choices, "usage": self.tracker.usage()}


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: "ServerState",
                                 lora: str | None = None):
    """Render the conversation (the served model was checked by the route: ``lora``, the
    adapter it selects), queue it, and answer with the whole response or an SSE stream."""
    params = body.sampling_params()
    metadata = body.metadata(request.headers.get(TENANT_HEADER))
    arrival = time.perf_counter()
    prompt = await state.engine.call(lambda engine: render_chat(engine.tokenizer, body.messages,
                                                                body.add_generation_prompt))
    stream = state.engine.open_stream(1)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        prompt_tokens = await state.engine.add(stream, prompt, params, request_id, arrival, metadata, lora,
                                               body.cache_salt)
    except BaseException:
        stream.abort()
        raise
    tracker = ChoiceTracker([request_id], params.n, prompt_tokens, collect=not body.stream)
    responder = ChatResponder(body, lora or state.model_name, tracker)
    if body.stream:
        return EventStreamResponse(responder.events(stream), stream)
    return await until_disconnected(request, responder.whole(stream))
