"""The scheduling-policy contract: in which order requests are served and whom to preempt.

A policy composes with any batching scheduler: the scheduler decides how many requests
and tokens a step holds (its batching), the policy which requests they are. Schedulers
built on ``QueueScheduler`` ask the policy at every decision; a third-party scheduler
finds it in ``SchedulerContext.policy``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from servelab.core.request import Request

if TYPE_CHECKING:
    from servelab.core.clock import Clock


@dataclass
class SLOClass:
    """A service level: the first token within ``ttft`` seconds of arrival, each next one
    within ``tpot`` seconds of the one before on average."""

    ttft: float
    tpot: float

    @classmethod
    def parse(cls, classes: Mapping[str, Any]) -> tuple[dict[str, "SLOClass"], list[str]]:
        """The classes of an engine's ``slo_classes`` config (name to ``{ttft, tpot}``),
        and every problem found: each needs exactly ``ttft`` and ``tpot``, each a number of
        seconds > 0."""
        parsed: dict[str, SLOClass] = {}
        problems: list[str] = []
        for name, targets in classes.items():
            keys = set(targets) if isinstance(targets, Mapping) else None
            if keys != {"ttft", "tpot"}:
                problems.append(f"slo_classes.{name} must be {{ttft: seconds, tpot: seconds}}, got {targets!r}")
                continue
            bad = [f"slo_classes.{name}.{key} must be a number of seconds > 0, got {targets[key]!r}"
                   for key in ("ttft", "tpot") if not isinstance(targets[key], (int, float))
                   or isinstance(targets[key], bool) or not targets[key] > 0]
            problems += bad
            if not bad:
                parsed[name] = cls(float(targets["ttft"]), float(targets["tpot"]))
        return parsed, problems

    def attained(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether a request with these latencies met the class (no first token: missed;
        no second token: only the first-token target counts)."""
        return ttft is not None and ttft <= self.ttft and (tpot is None or tpot <= self.tpot)


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What the engine hands a policy: its ``clock`` (the scheduler's) and the
    ``slo_classes`` requests may name."""

    clock: Clock
    slo_classes: Mapping[str, SLOClass] = field(default_factory=dict)


class SchedulingPolicy(abc.ABC):
    """Orders a scheduler's requests; built as ``cls(config, PolicyContext)``.

    ``pick`` chooses the next waiting request to admit (the scheduler asks again after
    each admission, so a policy may update its state in between through ``on_admitted``);
    ``order_running`` ranks running requests, most important first, and the scheduler
    preempts from the end of that ranking when blocks run out. ``preemption_victim`` lets
    a waiting request displace a running one (priority scheduling); ``hopeless`` names
    waiting requests to refuse. A policy never changes what a request generates, only
    when: greedy outputs are the same under every policy.
    """

    passive: bool = False
    """True for a policy that admits in the scheduler's queue order, ranks running
    requests in it, keeps no accounting and refuses nothing (``fcfs``): the engine and
    the schedulers skip asking it."""

    def __init__(self, config: object, context: PolicyContext):
        self.config = config
        self.context = context

    def check_request(self, request: Request) -> None:
        """Raise ``InvalidRequestError`` naming the field if this policy cannot serve the
        request (called before it is queued); the default accepts every request."""

    @abc.abstractmethod
    def pick(self, waiting: Sequence[Request]) -> Request:
        """The waiting request to admit next (``waiting`` is not empty; it is in the
        scheduler's queue order: arrival, preempted requests first)."""

    def order_running(self, running: list[Request]) -> list[Request]:
        """Running requests, most important first (given in the scheduler's order, oldest
        admitted first); the default keeps that order."""
        return running

    def preemption_victim(self, request: Request, candidates: Sequence[Request]) -> Request | None:
        """The running request (one of ``candidates``) to preempt so that waiting
        ``request`` fits, or None to let it wait; the default never preempts for admission."""
        return None

    def hopeless(self, waiting: Sequence[Request]) -> list[Request]:
        """Waiting requests to refuse now (finish reason ``deadline``); the default refuses none."""
        return []

    def on_queued(self, request: Request, waiting: Sequence[Request]) -> None:
        """A new request joined the waiting queue (``waiting``, which holds it); not
        called for a preempted request going back to it."""

    def on_admitted(self, request: Request) -> None:
        """A waiting request was admitted."""

    def on_tokens(self, request: Request, num_tokens: int) -> None:
        """A request kept ``num_tokens`` generated tokens this step."""

    def on_finished(self, request: Request) -> None:
        """A request finished or was aborted."""
