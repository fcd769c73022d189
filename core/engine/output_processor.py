"""Turns request state into ``RequestOutput`` objects: final, cumulative or delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelab.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from servelab.core.request import Request

OUTPUT_KINDS = ("final", "cumulative", "delta")


@dataclass
class RequestGroup:
    """The ``n`` sequences of one prompt and what was already emitted for each."""

    request_id: str
    children: list[Request]
    output_kind: str
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        """True when every sequence stopped."""
        return all(c.is_finished for c in self.children)


class OutputProcessor:
    """Groups child sequences per prompt and renders text.

    ``final`` groups emit once, when every sequence has stopped (text decoded once);
    ``cumulative`` groups emit everything so far at each step; ``delta`` groups emit only
    what is new (streaming), holding back text that may still become a stop string.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}

    def add(self, request_id: str, children: list[Request], output_kind: str) -> None:
        """Track a new prompt's sequences."""
        n = len(children)
        self.groups[request_id] = RequestGroup(request_id, children, output_kind, [0] * n, [0] * n)

    def child_ids(self, request_ids: list[str]) -> list[str]:
        """Sequence ids of the given prompt ids (unknown ids are ignored)."""
        return [c.request_id for rid in request_ids if rid in self.groups for c in self.groups[rid].children]

    def process(self, changed: list[Request]) -> list[RequestOutput]:
        """Outputs for every group touched by ``changed``; finished groups are dropped."""
        outputs = []
        seen: set[str] = set()
        for request in changed:
            group_id = request.group_id
            if group_id in seen or group_id not in self.groups:
                continue
            seen.add(group_id)
            group = self.groups[group_id]
            finished = group.finished
            if group.output_kind == "final" and not finished:
                continue
            outputs.append(self._render(group, finished))
            if finished:
                del self.groups[group_id]
        return outputs

    def _text(self, request: Request) -> str:
        if request.detokenizer is not None:
            if request.stop_text_len is not None:
                return request.detokenizer.text[:request.stop_text_len]
            if request.is_finished:
                request.detokenizer.flush()
            return request.detokenizer.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(request.output_token_ids,
                                     skip_special_tokens=request.sampling_params.skip_special_tokens)

    def _render(self, group: RequestGroup, finished: bool) -> RequestOutput:
        completions = []
        for i, child in enumerate(group.children):
            token_ids = child.output_token_ids
            text = self._text(child)
            logprobs = child.logprobs
            if group.output_kind == "delta":
                if not child.is_finished and child.sampling_params.stop_strings:
                    held = max(len(s) for s in child.sampling_params.stop_strings) - 1
                    text = text[:max(len(text) - held, group.sent_chars[i])]
                full_text, full_tokens = text, token_ids
                text = text[group.sent_chars[i]:]
                token_ids = token_ids[group.sent_tokens[i]:]
                logprobs = None if logprobs is None else logprobs[group.sent_tokens[i]:]
                group.sent_chars[i], group.sent_tokens[i] = len(full_text), len(full_tokens)
            completions.append(CompletionOutput(
                index=child.index, text=text, token_ids=token_ids,
                cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                logprobs=logprobs, finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        first = group.children[0]
        prompt_logprobs = first.prompt_logprobs
        if group.output_kind == "delta":
            prompt_logprobs, group.sent_prompt_logprobs = (None if group.sent_prompt_logprobs else prompt_logprobs,
                                                           True)
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min((c.first_scheduled_time for c in group.children
                                      if c.first_scheduled_time is not None), default=None),
            token_times=list(first.token_times) if len(group.children) == 1 else
            sorted(t for c in group.children for t in c.token_times),
            finished_time=max((c.finished_time or 0.0 for c in group.children), default=None) if finished else None,
            num_preemptions=sum(c.num_preemptions for c in group.children),
            num_cached_prompt_tokens=first.num_cached_prompt_tokens,
            spec_proposed_tokens=sum(c.spec_proposed for c in group.children),
            spec_accepted_tokens=sum(c.spec_accepted for c in group.children),
        )
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, finished, metrics,
                             prompt_logprobs)
