"""The pre-PagedAttention baseline: one reservation per request, made at admission.

``cache.reservation`` is how much a request reserves, the three policies the PagedAttention
paper (Kwon et al., SOSP 2023) compares against as Orca: ``max`` (the model's
``max_model_len``), ``pow2`` (the prompt plus the output length rounded up to a power of
two) and ``oracle`` (the prompt plus the true output length). The output length is the
request's ``max_tokens``, which is the true one when it ignores EOS (benchmarks do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_cache import Allocation, CacheContext, single_group
from servelab.core.request import Request
from servelab.plugins.cache.paged import PagedKVCacheManager
from servelab.plugins.cache.sizing import num_blocks_for

RESERVATIONS = ("max", "pow2", "oracle")
"""The reservation policies of ``cache.reservation``."""

POLICY_BLOCK_SIZE = 16
"""The allocation unit of ``pow2`` and ``oracle`` reservations when ``block_size`` is null."""


@dataclass
class ContiguousCacheConfig:
    """``cache=contiguous``: memory for ``num_slots`` reservations of ``max_model_len``
    tokens, or as much as fits ``memory_bytes`` when ``num_slots`` is null, or the
    executor's budget when both are null. ``reservation``: max | pow2 | oracle (module
    docstring). ``block_size``: the allocation unit of a reservation; null = the whole
    ``max_model_len`` under ``max`` (one region per request), 16 tokens otherwise.
    ``kv_dtype``: auto | int8 | fp8_e4m3, as for ``cache=paged``."""

    num_slots: Optional[int] = None
    memory_bytes: Optional[int] = None
    reservation: str = "max"
    block_size: Optional[int] = None
    kv_dtype: str = "auto"


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


class ContiguousKVCacheManager(PagedKVCacheManager):
    """Each admitted request reserves its whole region at its first allocation.

    This is the paged manager whose first allocation takes the request's reservation
    (``reservation_tokens``) at once, so the same attention path serves both caches; the
    unfilled part of every reservation is the waste that PagedAttention removes. A region
    is a whole number of ``block_size`` blocks, not necessarily adjacent in the pool
    (external fragmentation is not modelled). A request that outgrows its reservation
    (speculative lookahead past its last token) gets more blocks as the paged cache would;
    rolled-back drafts never shrink it below the reservation.
    """

    def __init__(self, config: ContiguousCacheConfig, context: CacheContext):
        if config.reservation not in RESERVATIONS:
            raise ConfigError([f"cache.reservation must be one of {', '.join(RESERVATIONS)}, got {config.reservation!r}"])
        max_len = context.spec.max_model_len
        block_size = config.block_size or (max_len if config.reservation == "max" else POLICY_BLOCK_SIZE)
        if config.num_slots is not None and config.num_slots < 1:
            raise ConfigError([f"cache.num_slots must be >= 1, got {config.num_slots}"])
        num_blocks = (config.num_slots * max_len // block_size if config.num_slots is not None else
                      num_blocks_for(None, config.memory_bytes, block_size, context, group="cache (contiguous)"))
        if num_blocks < 1:
            raise ConfigError([f"cache.num_slots={config.num_slots} x {max_len} tokens holds no block of "
                               f"cache.block_size={block_size}"])
        self._init_pool(config, context, block_size, num_blocks, single_group(context.spec))
        self._reserved: dict[str, int] = {}

    def reservation_tokens(self, request: Request) -> int:
        """Slots the request reserves at admission under ``cache.reservation``."""
        max_len = self.spec.max_model_len
        if self.config.reservation == "max":
            return max_len
        prompt = request.num_prompt_tokens
        output = request.sampling_params.max_tokens
        output = max_len - prompt if output is None else output
        if self.config.reservation == "pow2":
            output = next_power_of_two(output)
        return min(max_len, prompt + output)

    def allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> Allocation | None:
        """The first allocation takes the whole reservation; later ones add blocks only past it."""
        rid = request.request_id
        reserve = self._reserved.get(rid) or self.reservation_tokens(request)
        ahead = max(num_lookahead_tokens, reserve - request.num_computed_tokens - num_new_tokens)
        allocation = super().allocate(request, num_new_tokens, ahead)
        if allocation is not None:
            self._reserved[rid] = reserve
        return allocation

    def _free_id(self, rid: str) -> None:
        self._reserved.pop(rid, None)
        super()._free_id(rid)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Forget tokens past ``num_tokens``; blocks are released only past the reservation."""
        rid = request.request_id
        super().truncate(request, max(num_tokens, self._reserved.get(rid, 0)))
        if rid in self._used_slots:
            self._set_used(rid, min(self._used_slots[rid], num_tokens))

    @property
    def supports_fork(self) -> bool:
        """The baseline never shares regions between sequences."""
        return False


SPEC = ComponentSpec("cache", "contiguous", ContiguousKVCacheManager, ContiguousCacheConfig,
                     "one reservation per request at admission: max_model_len, pow2 or oracle (pre-PagedAttention)")
