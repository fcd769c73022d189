"""Turning a chat conversation into a prompt.

A tokenizer with a chat template renders it (Jinja, ``add_generation_prompt`` as asked).
Tokenizers without one (base models, servelab's byte-level tokenizer) use the fallback
template: one ``<|role|>`` line and the content per turn, then ``<|assistant|>``::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

"""

from __future__ import annotations

from typing import Any, Sequence

from servelab.core.errors import InvalidRequestError
from servelab.server.protocol import ChatMessage


def fallback_chat_prompt(messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The fallback template: ``<|role|>\\ncontent\\n`` per turn, then ``<|assistant|>\\n``."""
    turns = "".join(f"<|{m.role}|>\n{m.text()}\n" for m in messages)
    return turns + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages``: the tokenizer's chat template when it has one,
    the fallback template otherwise."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return fallback_chat_prompt(messages, add_generation_prompt)
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # templates reject conversations with raise_exception(...)
        raise InvalidRequestError("messages", f"the chat template rejected the conversation: {exc}") from exc
