"""Queues, preemption, token accounting and stop handling shared by every policy."""

from __future__ import annotations

import time
from collections import deque

from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import ScheduledRequest, Scheduler, SchedulerContext, SchedulerOutput


class QueueScheduler(Scheduler):
    """A waiting deque and a running list; policies implement ``schedule``.

    Preemption is by recompute: the newest running request gives up its blocks and goes
    back to the front of the queue with ``num_computed_tokens = 0``.
    """

    def __init__(self, config, context: SchedulerContext):
        self.config = config
        self.context = context
        self.cache = context.cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions = 0

    # -- queue bookkeeping -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request at the back."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        """Requests holding cache."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests."""
        return len(self.waiting)

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Finish the given requests with reason ``abort`` and free their cache."""
        wanted = set(request_ids)
        found = [r for r in (*self.waiting, *self.running) if r.request_id in wanted]
        if found:
            self.waiting = deque(r for r in self.waiting if r.request_id not in wanted)
            self.running = [r for r in self.running if r.request_id not in wanted]
            for request in found:
                request.finish_reason = "abort"
                self._finish(request)
        return found

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        request.finished_time = time.perf_counter()
        self.cache.free(request)
        self.context.on_request_finished(request)

    def _preempt(self, request: Request) -> None:
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- building a step -----------------------------------------------------------------
    def _grant(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.perf_counter()
        request.status = RequestStatus.RUNNING
        computed = request.num_computed_tokens
        return ScheduledRequest(request, computed, num_new_tokens, self.cache.block_table(request),
                                computed + num_new_tokens >= request.num_tokens)

    def _lookahead(self, request: Request, num_new_tokens: int) -> int:
        """Speculative slots to reserve: only for requests already decoding."""
        return self.context.num_lookahead_tokens if request.num_tokens - request.num_computed_tokens == num_new_tokens == 1 else 0

    def _schedule_running(self, budget: int, max_new_tokens: int | None = None) -> tuple[list[ScheduledRequest], int, list[str]]:
        """Give each running request (oldest first) its remaining tokens, up to
        ``max_new_tokens`` each and ``budget`` in all; preempt the newest when the cache
        is full. Returns (grants, tokens used, preempted ids)."""
        grants: list[ScheduledRequest] = []
        preempted: list[str] = []
        queue = deque(self.running)
        kept: list[Request] = []
        used = 0
        while queue:
            request = queue.popleft()
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, max_new_tokens or remaining, budget - used)
            lookahead = self._lookahead(request, num_new)
            if num_new <= 0 or (lookahead and used + num_new + lookahead > budget):
                kept.append(request)
                continue
            while self.cache.allocate(request, num_new, lookahead) is None:
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
        """Admit waiting requests in arrival order while ``max_running``, ``budget`` and the
        cache allow. Whole prompts only, unless ``chunk`` lets the last one take part of
        its prompt. Returns (grants, tokens used)."""
        grants: list[ScheduledRequest] = []
        used = 0
        while self.waiting and len(self.running) < max_running:
            request = self.waiting[0]
            if request.num_computed_tokens == 0:
                request.num_computed_tokens = self.cache.lookup_prefix(request)
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget - used) if chunk else remaining
            if num_new <= 0 or num_new > budget - used:
                break
            if self.cache.allocate(request, num_new) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            grants.append(self._grant(request, num_new))
            used += num_new
        return grants, used

    def _output(self, grants: list[ScheduledRequest], preempted: list[str] = ()) -> SchedulerOutput:
        self.step_index += 1
        prefill = sum(g.num_new_tokens for g in grants if g.request.num_tokens - g.num_computed_tokens > 1)
        decode = sum(g.num_new_tokens for g in grants) - prefill
        return SchedulerOutput(tuple(grants), num_prefill_tokens=prefill, num_decode_tokens=decode,
                               preempted=tuple(preempted), num_lookahead_tokens=self.context.num_lookahead_tokens,
                               step_index=self.step_index)

    # -- applying a step's result ---------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, token_ids: list[list[int]] | None) -> list[Request]:
        """Advance token accounting, append sampled tokens, finish stopped requests."""
        now = time.perf_counter()
        changed: list[Request] = []
        samples = iter(token_ids or ())
        finished = False
        stop_checker = self.context.stop_checker
        speculative = self.context.num_lookahead_tokens > 0
        for grant in output.scheduled:
            request = grant.request
            request.num_computed_tokens = grant.num_computed_tokens + grant.num_new_tokens
            if not grant.samples:
                continue
            new_tokens = next(samples)
            if request.is_finished:
                continue
            kept = stop_checker.append(request, new_tokens, now)
            request.num_computed_tokens += kept - 1
            changed.append(request)
            if request.finish_reason is not None:
                self._finish(request)
                finished = True
            elif speculative:
                self.cache.truncate(request, request.num_tokens)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return changed
