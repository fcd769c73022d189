"""Closed-loop workloads: sessions whose next request resends the whole context.

A session (a chat of ``workload.multi_turn``, an agent loop of ``workload.agentic``) is a
list of ``Turn``s. Its first request is sent at the session's start (by the workload's
arrival process); request k+1 is request k's prompt, request k's actual output tokens and
turn k+1's new message, sent the turn's delay (think time, tool latency) after request k's
last token. The runner asks ``Sessions.follow_up`` for it when request k finishes, so
the output is fed back exactly and a prefix cache can find the history. A session stops
after its last turn, at a failed request, or when the next prompt plus its output would
not fit ``max_model_len`` (counted as ``stopped_by_context``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from servelab.bench.arrivals import arrival_offsets
from servelab.bench.lengths import clamp_lengths
from servelab.bench.metrics import RequestRecord, distribution_ms, prefix_cache_hit_rate
from servelab.bench.prompts import PromptSource
from servelab.bench.workload import BenchRequest, TokenSpace, shared_prefixes
from servelab.core.errors import ConfigError

DELAYS = ("exponential", "fixed")


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: ``message`` tokens appended to the context, ``max_tokens``
    outputs wanted, sent ``delay_s`` seconds after the previous request's last token (the
    first turn: at the session's start, ``delay_s`` unused)."""

    message: tuple[int, ...]
    max_tokens: int
    delay_s: float


def check_delay(kind: str, mean_s: float, field: str) -> list[str]:
    """Problems of a delay distribution ``workload.<field>`` (kind) with mean
    ``workload.<field>_s``."""
    problems = []
    if kind not in DELAYS:
        problems.append(f"workload.{field} must be one of {', '.join(DELAYS)}, got {kind!r}")
    if not mean_s >= 0:
        problems.append(f"workload.{field}_s must be >= 0 seconds, got {mean_s}")
    return problems


def draw_delay(kind: str, mean_s: float, rng: random.Random) -> float:
    """A delay of mean ``mean_s`` seconds: ``fixed`` or ``exponential``."""
    if kind == "fixed" or mean_s == 0:
        return mean_s
    return rng.expovariate(1.0 / mean_s)


@dataclass
class _Session:
    """Where one session stands: its turns, the next turn's index, the last prompt sent
    and that request's arrival offset."""

    name: str
    turns: list[Turn]
    next_turn: int
    prompt: tuple[int, ...]
    offset_s: float
    stopped_by_context: bool = False


class Sessions:
    """The closed-loop workload of one run: ``requests`` (every session's first request,
    by arrival), ``follow_up`` (the next request when one finishes) and ``summary``."""

    def __init__(self, kind: str, session_word: str, turn_word: str, starts: Sequence[float],
                 plans: Sequence[list[Turn]], max_model_len: int):
        self.kind = kind
        self.turn_word = turn_word
        self.max_model_len = max_model_len
        self.sessions = [_Session(f"{session_word}{i}", turns, 1, turns[0].message, start)
                         for i, (start, turns) in enumerate(zip(starts, plans))]
        self.turn_of: dict[str, tuple[_Session, int]] = {}
        self.requests = [self._request(session, 0) for session in self.sessions]

    def _request(self, session: _Session, index: int) -> BenchRequest:
        request_id = f"{session.name}-{self.turn_word}{index}"
        self.turn_of[request_id] = (session, index)
        return BenchRequest(request_id, session.prompt, session.turns[index].max_tokens, session.offset_s)

    def follow_up(self, record: RequestRecord) -> BenchRequest | None:
        """The session's next request after ``record`` finished (its prompt: the last
        prompt, ``record``'s output tokens and the next message; its arrival offset: the
        last one + ``record``'s E2E + the turn's delay); None when the session is over."""
        session, _ = self.turn_of[record.request_id]
        if not record.ok or session.next_turn >= len(session.turns):
            return None
        if record.output_token_ids is None:
            raise ConfigError([f"workload.{self.kind} feeds each output back, but the system under test does not "
                               f"report output token ids"])
        turn = session.turns[session.next_turn]
        prompt = session.prompt + record.output_token_ids + turn.message
        if len(prompt) + turn.max_tokens > self.max_model_len:
            session.stopped_by_context = True
            return None
        session.prompt = prompt
        session.offset_s += record.e2e + turn.delay_s
        session.next_turn += 1
        return self._request(session, session.next_turn - 1)

    def summary(self, records: Sequence[RequestRecord]) -> dict[str, Any]:
        """Per-session counts and, for first requests and for later ones (where a prefix
        cache can hold the history), TTFT and the prefix-cache hit rate by tokens."""
        first = [r for r in records if self.turn_of.get(r.request_id, (None, -1))[1] == 0]
        later = [r for r in records if self.turn_of.get(r.request_id, (None, 0))[1] > 0]

        def part(group: list[RequestRecord]) -> dict[str, Any]:
            done = [r for r in group if r.ok]
            return {"num_requests": len(group), "ttft_ms": distribution_ms([r.ttft for r in done]),
                    "prefix_cache_hit_rate": prefix_cache_hit_rate(done),
                    "mean_prompt_tokens": sum(r.num_prompt_tokens for r in done) / len(done) if done else None}

        sent = [s.next_turn for s in self.sessions]
        return {"kind": self.kind, "num_sessions": len(self.sessions),
                "planned_turns": sum(len(s.turns) for s in self.sessions), "sent_turns": sum(sent),
                "mean_turns": sum(sent) / len(sent),
                "stopped_by_context": sum(s.stopped_by_context for s in self.sessions),
                "first_turns": part(first), "later_turns": part(later)}


def is_closed_loop(cfg: Any) -> bool:
    """True when the workload ``cfg`` sets ``multi_turn`` or ``agentic``."""
    return getattr(cfg, "multi_turn", None) is not None or getattr(cfg, "agentic", None) is not None


def build_sessions(cfg: Any, space: TokenSpace, rate: float | None = None) -> Sessions:
    """The closed-loop sessions of the workload ``cfg`` (``multi_turn`` or ``agentic``):
    starts by ``arrival`` at ``rate`` (or ``cfg.rate``) sessions/s, each opening with one of
    the shared prefixes; the first request is clamped to the context like any request."""
    from servelab.bench.agentic import agentic_turns
    from servelab.bench.multi_turn import multi_turn_turns

    if cfg.multi_turn is not None and cfg.agentic is not None:
        raise ConfigError(["workload.multi_turn and workload.agentic are exclusive: set one (the other null)"])
    if cfg.tenants:
        raise ConfigError([f"workload.tenants cannot be combined with workload."
                           f"{'multi_turn' if cfg.multi_turn is not None else 'agentic'}"])
    kind, build, session_word, turn_word = (("multi_turn", multi_turn_turns, "conv", "turn")
                                            if cfg.multi_turn is not None
                                            else ("agentic", agentic_turns, "session", "step"))
    seed = str(cfg.seed)
    source = PromptSource(cfg.prompts, space.vocab_size, space.tokenizer, cfg.corpus_file,
                          random.Random(f"{seed}:prompts"))
    prefix = shared_prefixes(cfg, source, seed)
    plans = build(cfg, space, source, seed)
    starts = arrival_offsets(cfg.arrival, len(plans), cfg.rate if rate is None else rate, cfg.burstiness,
                             random.Random(f"{seed}:arrivals"))
    for turns in plans:
        opening = tuple(prefix()) + turns[0].message
        prompt_len, max_tokens = clamp_lengths(len(opening), turns[0].max_tokens, space.max_model_len)
        turns[0] = Turn(opening[:prompt_len], max_tokens, 0.0)
    return Sessions(kind, session_word, turn_word, starts, plans, space.max_model_len)
