"""The prompt a router sees of an HTTP request, read before any replica is chosen."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from servelab.core.errors import InvalidRequestError
from servelab.server.chat_template import render_chat
from servelab.server.protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


def routing_prompt(path: str, body: bytes, tokenizer: Any) -> tuple[int, ...] | None:
    """The token ids of the (first) prompt of a completion or chat request, as the
    engine will see them (chat: rendered with the chat template; text: encoded without
    special tokens). None for other paths and for bodies the replica will reject anyway."""
    try:
        if path == COMPLETIONS_PATH:
            prompt = CompletionRequest.model_validate_json(body).prompts()[0]
        elif path == CHAT_PATH:
            chat = ChatCompletionRequest.model_validate_json(body)
            prompt = render_chat(tokenizer, chat.messages, chat.add_generation_prompt)
        else:
            return None
    except (ValidationError, InvalidRequestError):
        return None
    if isinstance(prompt, str):
        if tokenizer is None:
            return None
        return tuple(tokenizer.encode(prompt, add_special_tokens=False))
    return tuple(prompt)
