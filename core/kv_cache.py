"""The KV cache manager contract: who owns which cache slots."""

from __future__ import annotations

import abc
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from servelab.core.kv_cache_dtype import SCALE_BYTES, is_quantized
from servelab.core.request import Request

if TYPE_CHECKING:
    from servelab.core.component import ComponentBuilder
    from servelab.core.kv_tier import TierEntry


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers whose blocks a cache allocates together: ``layers`` (indices among one
    device's layers) and the ``sliding_window`` they share (None: they attend to every
    token, so every block is kept). A windowed group's table may point the entries wholly
    before the window at a placeholder block of the cache's choosing (all zeros, never
    written): attention never needs those keys."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one model needs stored per token.

    Fields: ``num_layers`` attention layers, each caching ``num_kv_heads`` x ``head_dim``
    keys and values in ``dtype`` (the cache's element type: the model's, or int8 /
    float8_e4m3fn with a float32 scale per slot and KV head, ``cache.kv_dtype``);
    ``max_model_len`` tokens at most per sequence; ``layer_windows``: each layer's
    attention window (None: the whole context; empty: every layer attends to the whole
    context); ``values_are_keys``: the layers cache keys alone and read their values from
    them (latent attention: one latent per token, ``AttentionSpec.values_are_keys``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_model_len: int
    layer_windows: tuple[int | None, ...] = ()
    values_are_keys: bool = False

    @property
    def kv_parts(self) -> int:
        """Tensors cached per token and KV head: 2 (key and value), 1 (values are keys)."""
        return 1 if self.values_are_keys else 2

    @property
    def layer_bytes_per_token(self) -> int:
        """Bytes of K and V (K alone when values are keys) for one token in one layer,
        scales included."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        row = self.head_dim * itemsize + (SCALE_BYTES if is_quantized(self.dtype) else 0)
        return self.kv_parts * self.num_kv_heads * row

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers (scales included)."""
        return self.num_layers * self.layer_bytes_per_token

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """The layers split into groups of equal size that share a window: the layers of
        each distinct window, in order, cut into runs of the greatest common divisor of
        the windows' layer counts (one group of every layer when all layers share a
        window). Equal sizes let every group's block ``b`` occupy the same slice of one
        set of per-position tensors (``layers_per_group`` of them), so one pool of blocks
        serves every group."""
        windows = self.layer_windows or (None,) * self.num_layers
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            by_window.setdefault(window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        return tuple(KVCacheGroup(tuple(layers[start:start + size]), window)
                     for window, layers in by_window.items() for start in range(0, len(layers), size))

    def block_bytes(self, block_size: int, groups: tuple[KVCacheGroup, ...] | None = None) -> int:
        """Bytes one block of ``block_size`` slots takes when the cache keeps ``groups``
        (default: one group of every layer): the K and V of a group's layers."""
        layers = len(groups[0].layers) if groups else self.num_layers
        return layers * self.layer_bytes_per_token * block_size


def single_group(spec: KVCacheSpec) -> tuple[KVCacheGroup, ...]:
    """Every layer in one group that keeps every token: a cache that ignores windows."""
    return (KVCacheGroup(tuple(range(spec.num_layers))),)


@dataclass(frozen=True, slots=True)
class CacheContext:
    """What the engine hands a KV cache manager: what one device stores per token
    (``spec``), the engine's ``registry`` (for the components a cache builds itself, such
    as its prefix-cache eviction policy), ``memory_budget_bytes``, the KV memory the
    executor can give each device (for a config that sets no size; None: unknown), and
    ``model_fingerprint`` (``kv_fingerprint``: what a block's content depends on beyond the
    cache's own layout, for a tier that outlives the engine)."""

    spec: KVCacheSpec
    registry: ComponentBuilder
    memory_budget_bytes: int | None = None
    model_fingerprint: str = ""


@dataclass(frozen=True, slots=True)
class Allocation:
    """Result of a successful ``allocate``.

    ``new_block_ids``: blocks added to the request's table by this call.
    ``blocks_to_copy``: (source, destination) pairs the runner must copy before the step
    (copy-on-write of a shared partial block).
    """

    new_block_ids: tuple[int, ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()


ROOT_HASH = 0x5E2E1AB
"""What a first block's hash chains from (a fixed number, so every process agrees)."""


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The hash of a block of ``tokens`` after the block hashed ``parent`` (None: the
    first block); equal in every process, so a router can compute what a cache reports."""
    return hash((ROOT_HASH if parent is None else parent, tokens))


@functools.lru_cache(maxsize=1024)
def prefix_root(cache_salt: str | None) -> int | None:
    """What the first block of a request with ``cache_salt`` chains from: None (the
    shared ``ROOT_HASH``) without a salt, else a number derived from the salt alone (the
    same in every process), so prefixes cached under one salt are never found under
    another."""
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "big") >> 1


def block_hashes(token_ids: list[int] | tuple[int, ...], block_size: int, num_blocks: int,
                 root: int | None = None) -> list[int]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``token_ids`` (the
    first chained from ``root``, a ``prefix_root``)."""
    hashes: list[int] = []
    for index in range(num_blocks):
        hashes.append(block_hash(hashes[-1] if hashes else root,
                                 tuple(token_ids[index * block_size:(index + 1) * block_size])))
    return hashes


@dataclass(frozen=True, slots=True)
class TierMoves:
    """What a cache with tiers below the device moves with the step being scheduled:
    ``offloads`` (device, host) of evicted cached blocks, ``loads`` (host, device) of
    prefix hits in the host tier, and its lower tier's ``spills`` (host block,
    ``TierEntry``) and ``fills`` (``TierEntry``, host block)."""

    offloads: tuple[tuple[int, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    spills: tuple[tuple[int, "TierEntry"], ...] = ()
    fills: tuple[tuple["TierEntry", int], ...] = ()


NO_TIER_MOVES = TierMoves()
"""What ``take_tier_moves`` returns when nothing moves (the engine checks for this object)."""


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """A change of what a cache can serve from its prefix cache: ``kind`` ``stored``
    (blocks whose content became findable on the device), ``moved`` (blocks that left the
    device, or the host, for the tier named ``tier`` below it, where a hit loads them
    back instead of recomputing them), ``evicted`` (blocks whose content it gave up in
    every tier) or ``held`` (every block it holds on the device now, replacing what was
    known: a snapshot), each block by its chained ``block_hash`` (of the first KV cache
    group)."""

    kind: str
    hashes: tuple[int, ...]
    tier: str = "device"


def apply_cache_events(held: set[int], events: Sequence[KVCacheEvent], below: set[int] | None = None) -> None:
    """Bring ``held``, the blocks a cache is known to hold in any tier, up to date with its
    ``events``; ``below`` (when given) keeps those of them that are below the device."""
    for event in events:
        if event.kind == "held":
            held.clear()
            if below is not None:
                below.clear()
        (held.difference_update if event.kind == "evicted" else held.update)(event.hashes)
        if below is not None:
            (below.update if event.kind == "moved" else below.difference_update)(event.hashes)


@dataclass(frozen=True, slots=True)
class KVCacheUsage:
    """A snapshot of cache occupancy, in token slots and blocks.

    ``used_slots``: slots holding a token of a live request. ``reserved_slots``: slots
    held by live requests (used or not). ``unread_slots``: used slots whose token no
    layer of theirs will read again (windowed layers' tokens before the window, which a
    cache that ignores windows keeps; a slot of a block shared by several layers counts
    by the share of those layers). ``waste`` is the fraction of the reserved slots that
    hold nothing attention reads. ``cached_blocks``: blocks kept only for prefix reuse.
    """

    total_slots: int
    reserved_slots: int
    used_slots: int
    total_blocks: int
    used_blocks: int
    cached_blocks: int = 0
    unread_slots: int = 0

    @property
    def usage(self) -> float:
        """Fraction of all slots reserved by live requests."""
        return self.reserved_slots / self.total_slots if self.total_slots else 0.0

    @property
    def read_slots(self) -> int:
        """Used slots whose token attention will read again."""
        return self.used_slots - self.unread_slots

    @property
    def waste(self) -> float:
        """Fraction of reserved slots that hold no token attention will read."""
        return 1.0 - self.read_slots / self.reserved_slots if self.reserved_slots else 0.0


class KVCacheManager(abc.ABC):
    """Owns the mapping from requests to cache blocks; never touches tensors.

    Built as ``cls(config, CacheContext)``; a constructor raises ``ConfigError`` listing
    every problem of its config. Every cache, paged or contiguous, is a pool of
    ``num_blocks`` blocks of ``block_size`` token slots; a request's ``block_table`` lists
    its blocks in position order. The runner allocates the tensors
    (``AttentionBackend.kv_cache_shape``) from these numbers.
    """

    #: Slots per block and blocks in the device pool.
    block_size: int
    num_blocks: int
    #: Blocks in the host pool that ``swap_out`` moves blocks to (0: no swapping).
    num_host_blocks: int = 0
    #: The KV cache groups the manager keeps a block table for, each request one table
    #: per group, in ``block_tables`` order: the spec's ``groups``, or ``single_group(spec)``
    #: (or empty) for a cache that keeps every layer's every token. Block ids index every
    #: group's layers alike.
    groups: tuple[KVCacheGroup, ...] = ()
    #: The placeholder block that windowed groups' tables hold for entries wholly before
    #: the window (None: tables hold only blocks of their own); never allocated.
    null_block: int | None = None

    @abc.abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> Allocation | None:
        """Make room for ``request.num_computed_tokens + num_new_tokens + num_lookahead_tokens``
        tokens. Returns None, with nothing changed, when there is no room."""

    @abc.abstractmethod
    def free(self, request: Request) -> None:
        """Release every block of ``request``; calling it again is harmless."""

    @abc.abstractmethod
    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep room for ``num_tokens`` tokens only (rolls back rejected speculative slots)."""

    @abc.abstractmethod
    def block_table(self, request: Request) -> list[int]:
        """The request's block ids in position order (read-only view), of the first group."""

    def block_tables(self, request: Request) -> tuple[list[int], ...]:
        """The request's block table of every group, in ``groups`` order (read-only views)."""
        return (self.block_table(request),)

    @property
    @abc.abstractmethod
    def usage(self) -> KVCacheUsage:
        """Current occupancy."""

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take now."""

    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold in this cache."""
        return self.num_blocks * self.block_size

    @property
    def prefix_caching(self) -> bool:
        """True when ``lookup_prefix`` can find cached blocks."""
        return False

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens found in the prefix cache so far (0 without prefix caching)."""
        return 0

    @property
    def prefix_queried_tokens(self) -> int:
        """Tokens looked up in the prefix cache so far."""
        return 0

    @property
    def prefix_evicted_blocks(self) -> int:
        """Cached blocks whose content was evicted so far (0 without prefix caching)."""
        return 0

    def lookup_prefix(self, request: Request) -> int:
        """Attach cached blocks matching the request's prompt; return the number of tokens
        found (a multiple of ``block_size``). Caches without prefix caching return 0."""
        return 0

    @property
    def supports_fork(self) -> bool:
        """True when ``fork`` is implemented."""
        return False

    def fork(self, parent: Request, child: Request) -> None:
        """Share the blocks holding ``parent``'s first ``child.num_computed_tokens`` tokens
        with ``child`` (copy-on-write); ``parent`` holds device blocks (it is running)."""
        raise NotImplementedError(f"{type(self).__name__} does not support sharing blocks between sequences")

    @property
    def supports_swap(self) -> bool:
        """True when ``swap_out``/``swap_in`` are implemented."""
        return False

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory; returns (device, host) block pairs or
        None when the host pool is full."""
        raise NotImplementedError(f"{type(self).__name__} does not support swapping")

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back; returns (host, device) block pairs or None when
        there is no room on the device."""
        raise NotImplementedError(f"{type(self).__name__} does not support swapping")

    def can_swap_in(self, request: Request) -> bool:
        """True when ``swap_in`` would succeed now."""
        return False

    def take_tier_moves(self) -> TierMoves:
        """The block moves of a cache with tiers below the device since the last call
        (``TierMoves``). The engine calls it after each ``schedule`` and adds them to that
        step (``SchedulerOutput.blocks_to_offload``, ``blocks_to_swap_in``,
        ``blocks_to_spill``, ``blocks_to_fill``); none by default."""
        return NO_TIER_MOVES

    @property
    def tier_hit_tokens(self) -> dict[str, int]:
        """Prompt tokens found so far in each tier below the device, by tier name (loaded
        back instead of recomputed); empty by default."""
        return {}

    def loading(self, request: Request) -> bool:
        """True while ``lookup_prefix`` found more of the request's prefix in a tier below
        the host and is loading it: the scheduler admits it from the next step. False by
        default."""
        return False

    def transfer_tier_blocks(self, spills: tuple, fills: tuple, read: Callable | None, write: Callable | None) -> None:
        """Run a step's ``blocks_to_spill`` and ``blocks_to_fill`` (an executor calls it
        before the step's other moves): ``read(host_block)`` gives a host block's content
        as one uint8 tensor, ``write(host_block, content)`` puts it back; None for both on
        an executor without KV tensors. A cache without a lower tier has none to run."""
        if spills or fills:
            raise NotImplementedError(f"{type(self).__name__} has no tier below the host")

    def start_events(self) -> None:
        """Begin recording ``KVCacheEvent``s for ``take_events`` (a KV-aware router reads
        them); a cache without a prefix cache records none."""

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (none by default)."""
        return []

    def shutdown(self) -> None:
        """Drop every block still held or cached, and release what the manager holds
        beyond its bookkeeping (files, host memory, connections); the engine calls it once,
        at its own shutdown, after every request was freed. Nothing by default."""
