"""Queues, preemption, token accounting and stop handling shared by every policy."""

from __future__ import annotations

import time
from collections import deque

from servelab.core.kv_cache import Allocation
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import (PreemptionMode, ScheduledRequest, Scheduler, SchedulerContext,
                                     SchedulerOutput)


class QueueScheduler(Scheduler):
    """A waiting deque, a running list and a swapped deque; policies implement ``schedule``.

    When blocks run out the newest running request is preempted. With
    ``config.preemption = recompute`` it gives up its blocks and returns to the front of the
    queue with ``num_computed_tokens = 0``; with ``swap`` its blocks move to the host pool
    (falling back to recompute when the pool is full) and come back, oldest first, before
    any new request is admitted.
    """

    def __init__(self, config, context: SchedulerContext):
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

    # -- queue bookkeeping -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request at the back."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def adopt(self, request: Request) -> None:
        """Add a forked sequence straight to the running list."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

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
        request.finished_time = time.perf_counter()
        self.cache.free(request)
        self.context.on_request_finished(request)

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        self.num_preemptions += 1
        if getattr(self.config, "preemption", PreemptionMode.recompute) is PreemptionMode.swap and self.cache.supports_swap:
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
        """Ask the cache for room; remember copy-on-write work for this step."""
        allocation: Allocation | None = self.cache.allocate(request, num_new_tokens, num_lookahead_tokens)
        if allocation is None:
            return False
        self._copies += allocation.blocks_to_copy
        return True

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
            if not self._allocate(request, num_new):
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
        output = SchedulerOutput(tuple(grants), num_prefill_tokens=prefill, num_decode_tokens=decode,
                                 blocks_to_swap_out=tuple(self._swap_out), blocks_to_swap_in=tuple(self._swap_in),
                                 blocks_to_copy=tuple(self._copies), preempted=tuple(preempted),
                                 num_lookahead_tokens=self.context.num_lookahead_tokens, step_index=self.step_index)
        self._swap_out, self._swap_in, self._copies = [], [], []
        return output

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
            if request.forks:
                self._fork(request)
            if request.beam is not None:  # its BeamGroup picks the token once every beam reported
                changed.append(request)
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

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is cached: its siblings share those blocks and each
        recomputes only the last prompt token (copy-on-write) to sample its own first token."""
        for child in parent.forks:
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            self.cache.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.forks = []
