"""Queues, preemption, token accounting and stop handling shared by every policy."""

from __future__ import annotations

from collections import deque
from typing import Any

from servelab.core.decoding import DecodeResult
from servelab.core.errors import ConfigError
from servelab.core.kv_cache import Allocation
from servelab.core.policy import SchedulingPolicy
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import (PreemptionMode, ScheduledRequest, Scheduler, SchedulerContext,
                                     SchedulerOutput, SchedulerUpdate)


class QueueScheduler(Scheduler):
    """A waiting deque, a running list and a swapped deque; policies implement ``schedule``.

    When blocks run out the newest running request is preempted. With
    ``config.preemption = recompute`` (also when the config has no ``preemption`` field) it
    gives up its blocks and returns to the front of the queue with
    ``num_computed_tokens = 0``; with ``swap`` its blocks move to the host pool (falling
    back to recompute when the pool is full) and come back, oldest first, before any new
    request is admitted. A prompt with ``n > 1`` sequences counts as ``n`` running
    requests from its admission on. A request granted in a step still in flight (a
    pipeline) sits out until its result comes back, and is never preempted meanwhile.
    The constructor raises ``ConfigError`` with every problem ``config_problems`` finds.
    """

    def __init__(self, config: Any, context: SchedulerContext):
        problems = self.config_problems(config, context)
        if problems:
            raise ConfigError(problems)
        self.config = config
        self.context = context
        self.cache = context.cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.step_index = 0
        self.num_preemptions = 0
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._copies: list[tuple[int, int]] = []
        self._prefix_hits = 0
        self._in_flight: set[str] = set()
        self._granted: set[str] = set()
        self._admission_preempted: list[str] = []
        self.refused: list[Request] = []
        passive = context.policy is None or context.policy.passive
        self.policy: SchedulingPolicy | None = None if passive else context.policy
        """The policy asked at every decision; None for a passive one (first come, first
        served), whose order is the queue's own."""

    @classmethod
    def config_problems(cls, config: Any, context: SchedulerContext) -> list[str]:
        """Every reason ``config`` cannot work in ``context`` (policies add their own):
        swap preemption needs a cache with a host pool."""
        if getattr(config, "preemption", None) is PreemptionMode.swap and not context.cache.supports_swap:
            return ["scheduler.preemption=swap needs a cache with a host pool for swapped blocks: set "
                    "cache.swap_space_bytes (cache=paged) or use scheduler.preemption=recompute"]
        return []

    @staticmethod
    def at_least(name: str, value: int | float, minimum: int | float) -> list[str]:
        """A problem naming ``scheduler.<name>`` when ``value`` is below ``minimum``."""
        return [f"scheduler.{name} must be >= {minimum}, got {value}"] if value < minimum else []

    @staticmethod
    def holds_a_prompt(name: str, budget: int | None, max_model_len: int) -> list[str]:
        """A problem when a per-step token budget ``scheduler.<name>`` cannot hold the
        longest prompt, which a policy that never splits prompts needs."""
        if budget is None or budget >= max_model_len:
            return []
        return [f"scheduler.{name}={budget} is below model.max_model_len={max_model_len}: a long prompt "
                f"could never be scheduled; raise it or use scheduler=chunked"]

    # -- queue bookkeeping -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request at the back."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if self.policy is not None:
            self.policy.on_queued(request, self.waiting)

    def has_unfinished(self) -> bool:
        """True while any request waits, runs or is swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running(self) -> int:
        """Requests holding cache."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued and swapped-out requests."""
        return len(self.waiting) + len(self.swapped)

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Finish the given requests with reason ``abort`` and free their cache."""
        wanted = set(request_ids)
        found = [r for r in (*self.waiting, *self.running, *self.swapped) if r.request_id in wanted]
        if found:
            self.waiting = deque(r for r in self.waiting if r.request_id not in wanted)
            self.running = [r for r in self.running if r.request_id not in wanted]
            self.swapped = deque(r for r in self.swapped if r.request_id not in wanted)
            for request in found:
                request.finish_reason = "abort"
                self._finish(request)
        return found

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        request.finished_time = self.context.clock.now()
        self.cache.free(request)
        if self.policy is not None:
            self.policy.on_finished(request)
        self.context.on_request_finished(request)

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        self.num_preemptions += 1
        if getattr(self.config, "preemption", PreemptionMode.recompute) is PreemptionMode.swap:
            pairs = self.cache.swap_out(request)
            if pairs is not None:
                request.status = RequestStatus.SWAPPED
                self._swap_out += pairs
                self.swapped.append(request)
                return
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _swap_in_ready(self) -> None:
        """Bring swapped requests back (oldest first) while the device has room."""
        while self.swapped and self.cache.can_swap_in(self.swapped[0]):
            request = self.swapped.popleft()
            self._swap_in += self.cache.swap_in(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Ask the cache for room (idle LoRA adapters of a unified pool give theirs back
        first); remember copy-on-write work for this step."""
        allocation: Allocation | None = self.cache.allocate(request, num_new_tokens, num_lookahead_tokens)
        adapters = self.context.adapters
        while allocation is None and adapters is not None and adapters.pool is not None and adapters.relieve(
                (*self.running, *self.swapped), request):
            allocation = self.cache.allocate(request, num_new_tokens, num_lookahead_tokens)
        if allocation is None:
            return False
        self._copies += allocation.blocks_to_copy
        return True

    # -- building a step -----------------------------------------------------------------
    def _grant(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.context.clock.now()
        request.status = RequestStatus.RUNNING
        self._granted.add(request.request_id)
        samples = request.num_computed_tokens + num_new_tokens >= request.num_tokens
        return ScheduledRequest.of(request, num_new_tokens, self.cache, samples)

    def _lookahead(self, request: Request, num_new_tokens: int) -> int:
        """Speculative slots to reserve: only for requests already decoding."""
        return self.context.num_lookahead_tokens if request.num_tokens - request.num_computed_tokens == num_new_tokens == 1 else 0

    def _schedule_running(self, budget: int, max_new_tokens: int | None = None) -> tuple[list[ScheduledRequest], int, list[str]]:
        """Give each running request (in the policy's ranking: oldest first under FCFS)
        its remaining tokens, up to ``max_new_tokens`` each and ``budget`` in all; preempt
        the last-ranked when the cache is full. Returns (grants, tokens used, preempted ids)."""
        grants: list[ScheduledRequest] = []
        preempted: list[str] = []
        kept: list[Request] = [r for r in self.running if r.request_id in self._in_flight]
        ready = [r for r in self.running if r.request_id not in self._in_flight]
        queue = deque(self.policy.order_running(ready) if self.policy is not None else ready)
        used = 0
        while queue:
            request = queue.popleft()
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, max_new_tokens or remaining, budget - used)
            lookahead = self._lookahead(request, num_new)
            if num_new <= 0 or (lookahead and used + num_new + lookahead > budget):
                kept.append(request)
                continue
            while not self._allocate(request, num_new, lookahead):
                victim = queue.pop() if queue else request
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                kept.append(request)
                grants.append(self._grant(request, num_new))
                used += num_new + lookahead
        self.running = kept
        return grants, used, preempted

    def _admit(self, budget: int, max_running: int, chunk: bool = False) -> tuple[list[ScheduledRequest], int]:
        """Admit waiting requests in the policy's order (``pick``) while ``max_running``,
        ``budget`` and the cache allow, after refusing those the policy finds hopeless.
        Whole prompts only, unless ``chunk`` lets the last one take part of its prompt.
        When the next request does not fit, the policy may preempt a running request for
        it (``preemption_victim``). With LoRA, ``context.adapters`` picks among the policy's
        choices so that the adapters of the requests holding cache fit the slots.
        Returns (grants, tokens used)."""
        grants: list[ScheduledRequest] = []
        used = 0
        self._refuse_hopeless()
        policy = self.policy
        adapters = self.context.adapters
        if adapters is not None and self.waiting:
            adapters.start((*self.running, *self.swapped))
        while self.waiting:
            if adapters is None:
                request = policy.pick(self.waiting) if policy is not None else self.waiting[0]
            else:
                request = adapters.pick(self.waiting, policy)
                if request is None:
                    break
            while len(self.running) + request.num_sequences > max_running:
                if not self._preempt_for(request):
                    return grants, used
            hit = 0
            if request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
                hit = self.cache.lookup_prefix(request)
                if not hit and self.cache.loading(request):
                    break  # its prefix arrives from a lower KV tier with this step
                request.num_computed_tokens = hit
                self._prefix_hits += hit
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget - used) if chunk else remaining
            if num_new <= 0 or num_new > budget - used:
                break
            lookahead = self._lookahead(request, num_new)  # one token left (all else cached): it decodes
            if num_new + lookahead > budget - used:
                lookahead = 0
            while not self._allocate(request, num_new, lookahead):
                if not self._preempt_for(request):
                    self._give_back_prefix(request, hit)
                    return grants, used
            self.waiting.remove(request)
            self.running.append(request)
            if policy is not None:
                policy.on_admitted(request)
            if adapters is not None:
                adapters.admitted(request)
            grants.append(self._grant(request, num_new))
            used += num_new + lookahead
        return grants, used

    def _give_back_prefix(self, request: Request, hit: int) -> None:
        """A waiting request the cache has no room for gives back the cached blocks its
        prefix lookup attached (``hit`` tokens of them in this step), so that requests
        waiting for memory never hold it: otherwise requests preempted in turn, each
        holding its own prefix, could fill the cache while nothing runs. It looks its
        prefix up again when next picked."""
        if request.num_computed_tokens:
            self._prefix_hits -= hit
            self.cache.free(request)
            request.num_computed_tokens = 0

    def _preempt_for(self, request: Request) -> bool:
        """Preempt the running request the policy gives up for waiting ``request`` (never
        one granted in this step or a step in flight); False when it names none."""
        granted = self._in_flight | self._granted
        candidates = [r for r in self.running if r.request_id not in granted]
        victim = self.policy.preemption_victim(request, candidates) if candidates and self.policy else None
        if victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim)
        self._admission_preempted.append(victim.request_id)
        return True

    def take_refused(self) -> list[Request]:
        """The requests the policy refused since the last call."""
        refused, self.refused = self.refused, []
        return refused

    def _refuse_hopeless(self) -> None:
        """Finish, with reason ``deadline``, the waiting requests the policy finds hopeless
        (and the sibling sequences that would have forked from them)."""
        hopeless = self.policy.hopeless(self.waiting) if self.waiting and self.policy is not None else ()
        for request in hopeless:
            self.waiting.remove(request)
            sequences, request.forks = (request, *request.forks), []
            for sequence in sequences:
                sequence.finish_reason = "deadline"
                self._finish(sequence)
            self.refused += sequences

    def _output(self, grants: list[ScheduledRequest], preempted: list[str] = ()) -> SchedulerOutput:
        self.step_index += 1
        preempted = [*preempted, *self._admission_preempted]
        prefill = sum(g.num_new_tokens for g in grants if g.request.num_tokens - g.num_computed_tokens > 1)
        decode = sum(g.num_new_tokens for g in grants) - prefill
        output = SchedulerOutput(tuple(grants), num_prefill_tokens=prefill, num_decode_tokens=decode,
                                 blocks_to_swap_out=tuple(self._swap_out), blocks_to_swap_in=tuple(self._swap_in),
                                 blocks_to_copy=tuple(self._copies), preempted=tuple(preempted),
                                 num_lookahead_tokens=self.context.num_lookahead_tokens,
                                 num_prefix_hit_tokens=self._prefix_hits, step_index=self.step_index)
        self._swap_out, self._swap_in, self._copies = [], [], []
        self._prefix_hits = 0
        self._admission_preempted = []
        self._granted = set()
        self._in_flight.update(g.request.request_id for g in grants)
        return output

    # -- applying a step's result ---------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: DecodeResult | None) -> SchedulerUpdate:
        """Advance token accounting; append each sampling request's tokens with their
        logprobs and speculative counts; finish stopped requests."""
        now = self.context.clock.now()
        changed: list[Request] = []
        generated = 0
        index = -1
        stop_checker = self.context.stop_checker
        policy = self.policy
        speculative = self.context.num_lookahead_tokens > 0
        in_flight = self._in_flight
        for grant in output.scheduled:
            request = grant.request
            in_flight.discard(request.request_id)
            request.num_computed_tokens = grant.num_computed_tokens + grant.num_new_tokens
            if not grant.samples:
                continue
            index += 1
            if request.is_finished:
                continue
            if request.forks:
                self._fork(request)
            logprobs = result.logprobs[index] if result.logprobs is not None else None
            kept = stop_checker.append(request, result.token_ids[index], logprobs, now)
            request.num_computed_tokens += kept - 1
            generated += kept
            if policy is not None:
                policy.on_tokens(request, kept)
            changed.append(request)
            if result.num_draft_tokens is not None:
                request.spec_proposed += result.num_draft_tokens[index]
                request.spec_accepted += result.num_accepted_drafts[index]
            if request.finish_reason is not None:
                self._finish(request)
            elif speculative:
                self.cache.truncate(request, request.num_tokens)
        if any(r.is_finished for r in changed):
            self.running = [r for r in self.running if not r.is_finished]
        return SchedulerUpdate(tuple(changed), generated)

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is cached: its siblings share those blocks and each
        recomputes only the last prompt token (copy-on-write) to sample its own first token."""
        for child in parent.forks:
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            self.cache.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.forks = []
