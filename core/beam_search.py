"""Beam search over the engine's sequences, sharing KV blocks through fork/copy-on-write."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from servelab.core.outputs import CompletionOutput
from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: generated ``token_ids``, summed ``logprob`` and length-normalised ``score``."""

    token_ids: tuple[int, ...]
    logprob: float
    score: float
    finish_reason: str


class BeamGroup:
    """The live beams of one prompt and its finished hypotheses.

    Every step each live beam yields its top ``2 * width`` next tokens (the request's
    logprobs); ``advance`` keeps the ``width`` best extensions: the first extension of a
    beam reuses its request, further ones fork it (its blocks are shared and copied on
    write), beams with no extension are dropped. EOS extensions become hypotheses.
    Scores are cumulative log-probabilities divided by length ** ``length_penalty``.
    """

    def __init__(self, request_id: str, params: SamplingParams, eos_token_id: int | None, max_model_len: int):
        self.request_id = request_id
        self.params = params
        self.width = params.best_of or params.n
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.max_model_len = max_model_len
        self.live: list[Request] = []
        self.scores: dict[str, float] = {}
        self.candidates: dict[str, dict] = {}
        self.finished: list[Hypothesis] = []
        self.done = False
        self._forks = 0

    @staticmethod
    def beam_params(params: SamplingParams) -> SamplingParams:
        """Per-beam parameters: argmax decoding that reports the top 2 x width tokens."""
        width = params.best_of or params.n
        return replace(params, n=1, best_of=None, temperature=0.0, logprobs=2 * width, use_beam_search=False,
                       stop=None, seed=None)

    def start(self, request: Request) -> None:
        """Track the first beam (the prompt)."""
        request.beam = self
        self.live = [request]
        self.scores[request.request_id] = 0.0

    def collect(self, request: Request, candidates: dict) -> None:
        """Record one beam's candidate next tokens (token id -> Logprob)."""
        self.candidates[request.request_id] = candidates

    def ready(self) -> bool:
        """True when every live beam has reported its candidates."""
        return all(r.request_id in self.candidates for r in self.live)

    def _score(self, logprob: float, length: int) -> float:
        return logprob / max(length, 1) ** self.params.length_penalty

    def advance(self, fork: Callable[[Request], Request], drop: Callable[[Request], None]) -> None:
        """Choose the next beams; ``fork(parent)`` returns a new request sharing the
        parent's blocks, ``drop(request)`` frees an abandoned beam."""
        now = time.perf_counter()
        ranked = sorted(((self.scores[b.request_id] + lp.logprob, b, token)
                         for b in self.live for token, lp in self.candidates[b.request_id].items()),
                        key=lambda item: -item[0])
        chosen: list[tuple[float, Request, int]] = []
        for logprob, beam, token in ranked:
            if token == self.eos_token_id and beam.num_output_tokens + 1 > self.params.min_tokens:
                output = tuple(beam.output_token_ids) + (token,)
                self.finished.append(Hypothesis(output, logprob, self._score(logprob, len(output)), "stop"))
                continue
            chosen.append((logprob, beam, token))
            if len(chosen) == self.width:
                break
        self.candidates.clear()
        used: set[str] = set()
        next_live = []
        for logprob, beam, token in chosen:
            request = fork(beam) if beam.request_id in used else beam
            used.add(beam.request_id)
            next_live.append((request, token, logprob))
        for beam in self.live:
            if beam.request_id not in used:
                drop(beam)
        self.live = []
        for request, token, logprob in next_live:
            request.token_ids.append(token)
            request.token_times.append(now)
            self.scores[request.request_id] = logprob
            self.live.append(request)
        self._finish_if_done(drop)

    def _finish_if_done(self, drop: Callable[[Request], None]) -> None:
        length_capped = any(r.num_output_tokens >= (self.params.max_tokens or self.max_model_len)
                            or r.num_tokens >= self.max_model_len for r in self.live)
        if length_capped or not self.live:
            for beam in self.live:
                output = tuple(beam.output_token_ids)
                logprob = self.scores[beam.request_id]
                self.finished.append(Hypothesis(output, logprob, self._score(logprob, len(output)), "length"))
        elif len(self.finished) >= self.width:
            best_live = max(self._score(self.scores[r.request_id], r.num_output_tokens) for r in self.live)
            worst_kept = sorted(h.score for h in self.finished)[-self.width]
            if best_live > worst_kept:
                return
        else:
            return
        for beam in self.live:
            drop(beam)
        self.live = []
        self.done = True

    def fork_id(self) -> str:
        """A fresh request id for a forked beam."""
        self._forks += 1
        return f"{self.request_id}#beam{self._forks}"

    def completions(self, decode: Callable[[list[int]], str]) -> list[CompletionOutput]:
        """The ``n`` best hypotheses, best first."""
        best = sorted(self.finished, key=lambda h: -h.score)[:self.params.n]
        return [CompletionOutput(index=i, text=decode(list(h.token_ids)), token_ids=list(h.token_ids),
                                 cumulative_logprob=h.logprob, finish_reason=h.finish_reason)
                for i, h in enumerate(best)]


def fork_beam(parent: Request, request_id: str) -> Request:
    """A new beam continuing ``parent``: same tokens, same computed count, same group."""
    child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_id,
                    parent.prompt, parent.arrival_time, 0, parent.group_id)
    child.token_ids = list(parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    child.first_scheduled_time = parent.first_scheduled_time
    child.token_times = list(parent.token_times)
    child.beam = parent.beam
    return child


def advance_ready_groups(groups: dict[str, BeamGroup], scheduler: Any, cache: Any) -> list[BeamGroup]:
    """Advance every beam group whose beams all reported; returns the groups that finished."""
    finished = []
    for group in list(groups.values()):
        if not group.live or not group.ready():
            continue

        def fork(parent: Request, group: BeamGroup = group) -> Request:
            child = fork_beam(parent, group.fork_id())
            cache.fork(parent, child)
            scheduler.adopt(child)
            return child

        group.advance(fork, lambda beam: scheduler.abort([beam.request_id]))
        if group.done:
            finished.append(groups.pop(group.request_id))
    return finished
