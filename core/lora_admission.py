"""Adapter-aware admission (S-LoRA's scheduler): a waiting request is admitted only while
the adapters of the requests holding cache fit the adapter slots, so that no step needs
more adapters than the device holds and none runs as several forward passes.

Every running (or swapped-out) request decodes in the coming steps, so the adapters that
must fit are theirs: the *active* adapters. A request for the base model or an active
adapter always fits; one for another adapter fits while fewer than ``max_adapters`` are
active. Among the waiting requests the scheduler's policy orders, those that cost no
adapter load go first (the base model's, an active adapter's, or one already resident
in a slot while there is room); the request the policy puts first is overtaken by at
most ``max_bypass`` admissions, after which nobody overtakes it and it waits for its
adapter to fit (running requests finish, their adapters go idle). With a unified pool
(``lora_pool.py``) an adapter that is not resident must also get its pages from the KV
block pool before its request is admitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Sequence

from servelab.core.errors import ConfigError
from servelab.core.request import Request

if TYPE_CHECKING:
    from servelab.core.lora_pool import UnifiedAdapterPool
    from servelab.core.policy import SchedulingPolicy


def active_adapters(requests: Iterable[Request]) -> set[int]:
    """The load ids of the adapters ``requests`` run with."""
    return {request.lora.load_id for request in requests if request.lora is not None}


class AdapterAdmission:
    """Admission for ``max_adapters`` slots (module docstring). ``resident()`` gives the
    load ids of the adapters in the slots now; ``pool``, when set, is the unified pool
    whose pages an adapter must hold (it is then the residency)."""

    def __init__(self, max_adapters: int, max_bypass: int, resident: Callable[[], Collection[int]],
                 pool: "UnifiedAdapterPool | None" = None):
        self.max_adapters = max_adapters
        self.max_bypass = max_bypass
        self.resident = pool.held.keys if pool is not None else resident
        self.pool = pool
        self.active: set[int] = set()
        self.bypasses = 0
        """Admissions that overtook the request the policy put first (counted over the run)."""
        self._head: str | None = None  # the request id the policy put first (no reference kept to it)
        self._head_bypassed = 0

    def start(self, holding: Iterable[Request]) -> None:
        """Begin an admission round: ``holding`` are the requests that hold cache (running
        and swapped out); their adapters are the active ones."""
        self.active = active_adapters(holding)
        if self.pool is not None:
            self.pool.release_unloaded(self.active)

    def fits(self, request: Request) -> bool:
        """Whether admitting ``request`` keeps the active adapters within the slots."""
        adapter = request.lora
        return adapter is None or adapter.load_id in self.active or len(self.active) < self.max_adapters

    def costs_no_load(self, request: Request, resident: Collection[int]) -> bool:
        """Whether ``request`` fits and needs no adapter paged in."""
        adapter = request.lora
        return adapter is None or adapter.load_id in self.active or (
            adapter.load_id in resident and len(self.active) < self.max_adapters)

    def pick(self, waiting: Sequence[Request], policy: "SchedulingPolicy | None") -> Request | None:
        """The waiting request to admit next, or None when none may be now (the first
        one's adapter does not fit and it may be overtaken no more, or nothing fits)."""
        first = policy.pick(waiting) if policy is not None else waiting[0]
        if first.request_id != self._head:
            self._head, self._head_bypassed = first.request_id, 0
        resident = self.resident()
        if self._head_bypassed >= self.max_bypass or self.costs_no_load(first, resident):
            chosen = first if self.fits(first) else None
        else:
            cheap = [request for request in waiting if self.costs_no_load(request, resident)]
            if cheap:
                chosen = policy.pick(cheap) if policy is not None else cheap[0]
            else:
                chosen = first if self.fits(first) else None
        if chosen is None:
            return None
        if self.pool is not None and chosen.lora is not None and not self.pool.hold(chosen.lora, self.active):
            return None
        if chosen is not first:
            self._head_bypassed += 1
            self.bypasses += 1
        return chosen

    def admitted(self, request: Request) -> None:
        """``request`` was admitted: its adapter is active."""
        if request.lora is not None:
            self.active.add(request.lora.load_id)

    def relieve(self, holding: Iterable[Request], request: Request) -> bool:
        """The KV cache is full while ``request`` asks for room: give back the pages of one
        idle adapter of the unified pool (no request in ``holding`` or ``request`` runs
        with it). False when there is no pool or no idle adapter."""
        if self.pool is None:
            return False
        busy = active_adapters(holding)
        if request.lora is not None:
            busy.add(request.lora.load_id)
        return self.pool.release_idle(busy)


def adapter_admission(lora_cfg: Any, executor: Any, cache: Any, block_bytes: int, element_bytes: int,
                      shards: int, max_model_len: int) -> AdapterAdmission | None:
    """The admission an engine's ``lora`` config asks for (None: ``lora.admission=false``)
    over ``executor``'s slots, with a unified pool in ``cache`` (blocks of ``block_bytes``;
    adapters at ``element_bytes`` per weight over ``shards`` ranks, beside requests of up
    to ``max_model_len`` tokens) when ``lora.unified_pool``; ``ConfigError`` naming the
    field for a setting that cannot work."""
    if lora_cfg.max_bypass < 0:
        raise ConfigError([f"lora.max_bypass must be 0 or more, got {lora_cfg.max_bypass}"])
    if not lora_cfg.admission:
        if lora_cfg.unified_pool:
            raise ConfigError(["lora.unified_pool=true needs lora.admission=true: an adapter gets its pages when "
                               "a request for it is admitted"])
        return None
    slots = executor.lora_stats().slots
    pool = None
    if lora_cfg.unified_pool:
        from servelab.core.lora_pool import UnifiedAdapterPool

        request_blocks = -(-max_model_len // cache.block_size) * max(1, len(cache.groups))
        pool = UnifiedAdapterPool(cache, block_bytes, element_bytes, slots, executor.evict_lora, shards,
                                  request_blocks)
    return AdapterAdmission(slots, lora_cfg.max_bypass, executor.lora_resident, pool)
