"""Incremental detokenization: text grows by whole characters as tokens arrive."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes a growing list of token ids without re-decoding everything each step.

    Keeps a window from ``prefix_offset``: the text of ``ids[prefix:read]`` is known, and
    new text is emitted only once decoding no longer ends in a partial character.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "prefix_offset", "read_offset", "text")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the sequence: emit the held-back tail even if it ends in a partial
        character (as a replacement character, like a full decode does)."""
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
