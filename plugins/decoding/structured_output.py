"""Structured output on xgrammar: one grammar matcher per constrained sequence, and the
whole batch's token bitmask filled and applied to the logits in one call each."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Sequence

import torch

from servelab.core.decoding import DecodingContext
from servelab.core.errors import InvalidRequestError
from servelab.core.request import Request
from servelab.core.structured_output import StructuredOutputParams

log = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
"""What xgrammar's cache of compiled grammars may hold before it evicts the oldest."""
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its time stamp and source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_LOCATION.sub("", text)[:500]


class _Tracked:
    """A sequence's matcher and how many of its output tokens the matcher consumed."""

    __slots__ = ("matcher", "consumed", "warned")

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.consumed = 0
        self.warned = False


class GrammarConstraints:
    """The engine's structured output state, built lazily from the ``DecodingContext``.

    One ``TokenizerInfo`` (the engine's tokenizer over the model's vocabulary, which may
    be wider than the tokenizer) and one caching ``GrammarCompiler``, so each distinct
    schema, regex or grammar compiles once. Each constrained sequence (every one of
    ``n``) gets its own matcher on its first sampling step. Before masking, a matcher
    consumes the tokens its sequence kept since the last step, read from the sequence
    itself: tokens kept before a preemption stay consumed, and a run cut by a stop
    condition is consumed as kept. ``release`` drops a finished or aborted sequence's matcher.
    """

    def __init__(self, context: DecodingContext | None):
        self.context = context
        self._compiler: Any = None
        self._batch: Any = None
        self._stop_token_ids: list[int] = []
        self._tracked: dict[Request, _Tracked] = {}

    @property
    def num_tracked(self) -> int:
        """Sequences holding a matcher now."""
        return len(self._tracked)

    def _ready(self, param: str) -> Any:
        """The compiler, built on first use (xgrammar is imported only then)."""
        if self._compiler is None:
            tokenizer = getattr(self.context, "tokenizer", None)
            if tokenizer is None:
                raise InvalidRequestError(param, "structured output needs a model with a tokenizer")
            import xgrammar

            try:
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.context.vocab_size)
            except Exception as exc:
                raise InvalidRequestError(param, f"this model's tokenizer cannot drive a grammar: {_reason(exc)}") from None
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            self._batch = xgrammar.BatchGrammarMatcher()
            self._stop_token_ids = list(info.stop_token_ids)
        return self._compiler

    def compile(self, spec: StructuredOutputParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache after the first time); raises
        ``InvalidRequestError`` naming ``spec.param`` if it does not compile."""
        compiler = self._ready(spec.param)
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec.json, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            return compiler.compile_grammar(choice_grammar(spec.choice) if kind == "choice" else spec.grammar)
        except Exception as exc:
            what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
            raise InvalidRequestError(spec.param, f"invalid {what}: {_reason(exc)}") from None

    def _tracked_for(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request)
        if tracked is None:
            import xgrammar

            params = request.sampling_params
            stops = list(dict.fromkeys(([] if request.eos_token_id is None else [request.eos_token_id])
                                       + params.stop_token_ids)) or self._stop_token_ids
            matcher = xgrammar.GrammarMatcher(self.compile(params.structured_output), override_stop_tokens=stops)
            tracked = self._tracked[request] = _Tracked(matcher)
        return tracked

    def _catch_up(self, requests: Sequence[Request], tracked: Sequence[_Tracked]) -> None:
        """Feed each matcher the tokens its sequence kept since it last looked, all
        matchers' k-th new tokens in one batched call."""
        pending = []
        for request, entry in zip(requests, tracked):
            start = request.num_prompt_tokens + entry.consumed
            if request.num_tokens > start:
                pending.append((request, entry, request.token_ids[start:]))
                entry.consumed = request.num_output_tokens
        for k in range(max((len(tokens) for _, _, tokens in pending), default=0)):
            live = [(r, e, tokens[k]) for r, e, tokens in pending if k < len(tokens) and not e.matcher.is_terminated()]
            accepted = self._batch.batch_accept_token([e.matcher for _, e, _ in live], [t for _, _, t in live])
            for (request, entry, token), ok in zip(live, accepted):
                if not ok and not entry.warned:
                    entry.warned = True
                    log.warning("request %s: token %d does not match its grammar; the matcher keeps its state",
                                request.request_id, token)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Mask (in place) every token row ``i`` of ``logits`` [N, V] that its constrained
        sequence ``requests[i]`` may not take next: -inf outside the grammar's next tokens,
        only the stop tokens once the grammar ended. Unconstrained rows are untouched."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured_output is not None
                and not r.is_finished]
        if not rows:
            return
        import xgrammar

        constrained = [requests[i] for i in rows]
        tracked = [self._tracked_for(r) for r in constrained]
        self._catch_up(constrained, tracked)
        vocab = logits.shape[-1]
        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], vocab)
        ended = [e.matcher.is_terminated() for e in tracked]
        live = [row for row, done in zip(rows, ended) if not done]
        if live:
            self._batch.batch_fill_next_token_bitmask([e.matcher for e, done in zip(tracked, ended) if not done],
                                                      bitmask, live)
        for row, entry, done in zip(rows, tracked, ended):
            if done:
                _allow_only(bitmask[row], entry.matcher.stop_token_ids)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=vocab, indices=rows)

    def release(self, request: Request) -> None:
        """Drop ``request``'s matcher (finished or aborted; idempotent)."""
        self._tracked.pop(request, None)


def _allow_only(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Set a bitmask row [ceil(V / 32)] int32 to allow exactly ``token_ids``."""
    row.zero_()
    for token in token_ids:
        if token < row.numel() * 32:
            bit = 1 << (token % 32)
            row[token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
