"""Beam search as a layer over the engine's public API: the engine, its requests, the
scheduler and the output processor know nothing of beams."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from servelab.core.errors import InvalidRequestError
from servelab.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_BEAM_WIDTH = 10
"""The widest beam: each step asks for the top ``2 * width`` tokens (logprobs <= 20)."""


@dataclass(frozen=True, slots=True)
class Beam:
    """A live hypothesis: its generated ``token_ids`` and their summed ``logprob``."""

    token_ids: tuple[int, ...]
    logprob: float


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: generated ``token_ids``, summed ``logprob`` and length-normalised ``score``."""

    token_ids: tuple[int, ...]
    logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamGroup:
    """One beam-search prompt: its live beams, the engine requests in flight for them
    (request id -> beam), the candidates they reported and the finished hypotheses."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    live: list[Beam] = field(default_factory=list)
    pending: dict[str, Beam] = field(default_factory=dict)
    reported: list[tuple[Beam, dict[int, Logprob]]] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    metadata: RequestMetadata = NO_METADATA

    @property
    def width(self) -> int:
        """Beams kept per step (``best_of``, else ``n``)."""
        return self.params.best_of or self.params.n

    def score(self, logprob: float, length: int) -> float:
        """Cumulative log-probability divided by length ** ``length_penalty``."""
        return logprob / max(length, 1) ** self.params.length_penalty

    def advance(self, max_model_len: int) -> bool:
        """Keep the ``width`` best extensions of the reported beams (EOS extensions past
        ``min_tokens`` become hypotheses); returns True when the search is over."""
        ranked = sorted(((beam.logprob + entry.logprob, beam, token)
                         for beam, candidates in self.reported for token, entry in candidates.items()),
                        key=lambda item: -item[0])
        self.reported = []
        self.live = []
        for logprob, beam, token in ranked:
            if token == self.eos_token_id:
                if len(beam.token_ids) + 1 > self.params.min_tokens:
                    output = beam.token_ids + (token,)
                    self.finished.append(Hypothesis(output, logprob, self.score(logprob, len(output)), "stop"))
                continue
            self.live.append(Beam(beam.token_ids + (token,), logprob))
            if len(self.live) == self.width:
                break
        return self._done(max_model_len)

    def _done(self, max_model_len: int) -> bool:
        max_tokens = self.params.max_tokens or max_model_len
        capped = any(len(b.token_ids) >= max_tokens or len(self.prompt_token_ids) + len(b.token_ids) >= max_model_len
                     for b in self.live)
        if not capped and self.live:
            if len(self.finished) < self.width:
                return False
            best_live = max(self.score(b.logprob, len(b.token_ids)) for b in self.live)
            worst_kept = sorted(h.score for h in self.finished)[-self.width]
            if best_live > worst_kept:
                return False
        else:
            self.finished += [Hypothesis(b.token_ids, b.logprob, self.score(b.logprob, len(b.token_ids)), "length")
                              for b in self.live]
        self.live = []
        return True

    def render(self, tokenizer: Any, now: float) -> RequestOutput:
        """The final output at time ``now``: the ``n`` best hypotheses, best first."""
        best = sorted(self.finished, key=lambda h: -h.score)[:self.params.n]
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else (lambda ids: "")
        completions = [CompletionOutput(index=i, text=decode(list(h.token_ids)), token_ids=list(h.token_ids),
                                        cumulative_logprob=h.logprob, finish_reason=h.finish_reason)
                       for i, h in enumerate(best)]
        metrics = RequestMetrics(arrival_time=self.arrival_time, first_scheduled_time=self.first_scheduled_time,
                                 token_times=list(self.token_times), finished_time=now)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, True, metrics)


class BeamSearch:
    """Beam search over an ``LLMEngine``, through its public API only.

    Every live beam of a step is one ordinary engine request: the prompt plus the beam's
    tokens, one greedy token, the top ``2 * width`` logprobs of the raw distribution.
    When all beams of a prompt have reported, the ``width`` best extensions are the next
    step's beams. Preemption, swapping and every scheduler and cache apply to beams as
    to any request; with ``cache.enable_prefix_caching=true`` the beams share their
    common full blocks through the prefix cache, otherwise every beam recomputes its
    context each step. Use ``add``/``abort`` in place of the engine's and pass every
    ``engine.step()`` result through ``process``.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.groups: dict[str, BeamGroup] = {}
        self._owner: dict[str, str] = {}
        self._ids = itertools.count()
        self._warned = False

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` naming the field if the beam search cannot run."""
        width = params.best_of or params.n
        if width > MAX_BEAM_WIDTH:
            raise InvalidRequestError("best_of", f"beam width (best_of or n) must be <= {MAX_BEAM_WIDTH}, got {width}")
        self.engine.check_request(token_ids, self._step_params(params))

    def add(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
            arrival_time: float | None = None, metadata: RequestMetadata = NO_METADATA) -> str:
        """Validate and start a beam search (``request_id`` default: ``beam<k>``); returns
        its id. Its ``RequestOutput`` comes out of ``process`` when it finishes. Each step's
        requests carry ``metadata``'s priority and tenant; a deadline or SLO class is
        refused (a beam search is many one-token requests, which a policy cannot hold to
        one target)."""
        request_id = f"beam{next(self._ids)}" if request_id is None else request_id
        if request_id in self.groups:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        for field_name in ("deadline", "slo_class"):
            if getattr(metadata, field_name) is not None:
                raise InvalidRequestError(field_name, f"beam search takes no {field_name} (priority and tenant only)")
        token_ids = self.engine.tokenize(prompt)
        self.check_request(token_ids, params)
        if not self.engine.cache.prefix_caching and not self._warned:
            self._warned = True
            log.warning("beam search without cache.enable_prefix_caching=true recomputes every beam's context "
                        "at every step")
        eos = None if params.ignore_eos else getattr(self.engine.tokenizer, "eos_token_id", None)
        group = BeamGroup(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, eos,
                          self.engine.clock.now() if arrival_time is None else arrival_time, live=[Beam((), 0.0)],
                          metadata=metadata)
        self.groups[request_id] = group
        self._submit(group)
        return request_id

    def abort(self, request_ids: list[str]) -> None:
        """Abort beam searches and engine requests by id (unknown ids are ignored)."""
        engine_ids = []
        for request_id in request_ids:
            group = self.groups.pop(request_id, None)
            if group is None:
                engine_ids.append(request_id)
                continue
            for sub_id in group.pending:
                del self._owner[sub_id]
                engine_ids.append(sub_id)
        self.engine.abort_request(engine_ids)

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The engine's outputs with the beams' own requests taken out, plus the output of
        every beam search that finished."""
        passed = []
        for output in outputs:
            group_id = self._owner.pop(output.request_id, None)
            if group_id is None:
                passed.append(output)
                continue
            group = self.groups[group_id]
            beam = group.pending.pop(output.request_id)
            if group.first_scheduled_time is None:
                group.first_scheduled_time = output.metrics.first_scheduled_time
            candidates = output.outputs[0].logprobs[0]
            top = sorted(candidates.values(), key=lambda entry: -entry.logprob)[:2 * group.width]
            group.reported.append((beam, {entry.token_id: entry for entry in top}))
            if group.pending:
                continue
            now = self.engine.clock.now()
            group.token_times.append(now)
            if group.advance(self.engine.max_model_len):
                passed.append(group.render(self.engine.tokenizer, now))
                del self.groups[group_id]
            else:
                self._submit(group)
        return passed

    def _submit(self, group: BeamGroup) -> None:
        params = self._step_params(group.params)
        for beam in group.live:
            sub_id = f"{group.request_id}#{next(self._ids)}"
            self.engine.add_request(group.prompt_token_ids + list(beam.token_ids), params, sub_id,
                                    arrival_time=group.arrival_time, metadata=group.metadata)
            group.pending[sub_id] = beam
            self._owner[sub_id] = group.request_id

    @staticmethod
    def _step_params(params: SamplingParams) -> SamplingParams:
        """One greedy token reporting the top ``2 * width`` candidates."""
        width = params.best_of or params.n
        return replace(params, n=1, best_of=None, temperature=0.0, logprobs=min(2 * width, 2 * MAX_BEAM_WIDTH),
                       max_tokens=1, min_tokens=0, ignore_eos=True, use_beam_search=False, stop=None,
                       stop_token_ids=None, seed=None)
