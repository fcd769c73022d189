"""``POST /v1/completions``: text completion, streamed or not."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import Request

from servelab.server.choices import ChoiceDelta, ChoiceTracker, best_choices
from servelab.server.errors import stream_error
from servelab.server.logprobs import completion_logprobs, echo_logprobs, joined_logprobs, vllm_prompt_logprobs
from servelab.server.output_stream import DONE, EventStreamResponse, OutputStream, sse, until_disconnected
from servelab.server.protocol import TENANT_HEADER, CompletionRequest, Prompt

if TYPE_CHECKING:
    from servelab.server.state import ServerState


@dataclass(frozen=True, slots=True)
class Echo:
    """A prompt as ``echo`` returns it: its ``text`` and its first token's text (the one
    token that has no logprob)."""

    text: str
    first_token_text: str


class CompletionResponder:
    """Builds the response of one completion request from its engine outputs."""

    def __init__(self, body: CompletionRequest, model: str, tracker: ChoiceTracker, echoes: list[Echo] | None):
        self.body = body
        self.tracker = tracker
        self.echoes = echoes
        self.header = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                       "model": model}
        self._offsets = [0] * tracker.num_choices

    def _echo(self, index: int, per_prompt: int | None = None) -> str:
        return self.echoes[index // (per_prompt or self.tracker.n)].text if self.echoes else ""

    def _logprobs(self, index: int, token_ids: list[int], entries: list | None, echoed_prompt: int | None) -> dict | None:
        """The choice's logprobs for these tokens, led by prompt ``echoed_prompt``'s when the
        prompt is echoed with logprobs here."""
        if self.body.logprobs is None:
            return None
        prompt_part = None
        if echoed_prompt is not None and self.body.echo_logprobs:
            prompt_part, self._offsets[index] = echo_logprobs(
                self.tracker.prompt_token_ids[echoed_prompt], self.tracker.prompt_logprobs[echoed_prompt],
                self.echoes[echoed_prompt].first_token_text)
        logprobs, self._offsets[index] = completion_logprobs(token_ids, entries or [], self._offsets[index])
        return logprobs if prompt_part is None else joined_logprobs(prompt_part, logprobs)

    def _prompt_logprobs(self, prompt: int) -> dict:
        if self.body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tracker.prompt_logprobs[prompt])}

    def _chunk_choice(self, delta: ChoiceDelta) -> dict:
        prompt = delta.index // self.tracker.n
        echo = self._echo(delta.index) if delta.first else ""
        self._offsets[delta.index] += len(echo)
        return {"index": delta.index, "text": echo + delta.text,
                "logprobs": self._logprobs(delta.index, delta.token_ids, delta.logprobs,
                                           prompt if delta.first else None),
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                **(self._prompt_logprobs(prompt) if delta.first else {})}

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        """The SSE chunks: one per choice delta, a usage chunk when asked, ``[DONE]``."""
        async with stream:
            try:
                async for output in stream:
                    for delta in self.tracker.update(output):
                        if delta.worth_sending() or (delta.first and (self.echoes or self.body.prompt_logprobs
                                                                      is not None)):
                            yield sse({**self.header, "choices": [self._chunk_choice(delta)]})
                if self.body.include_usage:
                    yield sse({**self.header, "choices": [], "usage": self.tracker.usage()})
            except Exception as exc:
                yield sse(stream_error(exc))
        yield DONE

    async def whole(self, stream: OutputStream) -> dict:
        """The non-streamed response, once every choice finished (with ``best_of``, the
        ``n`` best candidates of each prompt)."""
        async with stream:
            async for output in stream:
                self.tracker.update(output)
        collected, per_prompt = self.tracker.collected(), self.tracker.n
        if self.body.picks_best:
            collected, per_prompt = best_choices(collected, self.tracker.n, self.body.n), self.body.n
        choices = []
        for choice in collected:
            prompt = choice.index // per_prompt
            echo = self._echo(choice.index, per_prompt)
            self._offsets[choice.index] = len(echo)
            choices.append({"index": choice.index, "text": echo + choice.text,
                            "logprobs": self._logprobs(choice.index, choice.token_ids, choice.logprobs, prompt),
                            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                            **self._prompt_logprobs(prompt)})
        return {**self.header, "choices": choices, "usage": self.tracker.usage()}


async def _echoes(state: "ServerState", prompts: list[Prompt]) -> list[Echo]:
    """Each prompt's text and first token's text."""
    def decode(engine) -> list[Echo]:
        tokenizer, echoes = engine.tokenizer, []
        for prompt in prompts:
            ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
            echoes.append(Echo(prompt if isinstance(prompt, str) else tokenizer.decode(ids), tokenizer.decode(ids[:1])))
        return echoes

    return await state.engine.call(decode)


async def create_completion(body: CompletionRequest, request: Request, state: "ServerState", lora: str | None = None):
    """Validate (the served model was checked by the route: ``lora``, the adapter it
    selects), queue every prompt, and answer with the whole response or an SSE stream."""
    params = body.sampling_params()
    metadata = body.metadata(request.headers.get(TENANT_HEADER))
    prompts = body.prompts()
    arrival = time.perf_counter()
    stream = state.engine.open_stream(len(prompts))
    request_ids = [f"cmpl-{uuid.uuid4().hex}" for _ in prompts]
    try:
        prompt_tokens = 0
        for prompt, request_id in zip(prompts, request_ids):
            prompt_tokens += await state.engine.add(stream, prompt, params, request_id, arrival, metadata,
                                                    lora, body.cache_salt)
        echoes = await _echoes(state, prompts) if body.echo else None
    except BaseException:
        stream.abort()
        raise
    tracker = ChoiceTracker(request_ids, params.n, prompt_tokens, collect=not body.stream,
                            returns_tokens=body.generates)
    responder = CompletionResponder(body, lora or state.model_name, tracker, echoes)
    if body.stream:
        return EventStreamResponse(responder.events(stream), stream)
    return await until_disconnected(request, responder.whole(stream))
