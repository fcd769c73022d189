"""``executor=simulated``: every step priced by a cost model on a virtual clock; no model runs.

The scheduler, the KV cache manager (allocation, prefix caching, copy-on-write, swapping,
preemption) and the decoding strategy's accounting are the engine's own; only the forward
pass is replaced by its price. Requests get random tokens, so they end at their
``max_tokens`` (a benchmark's ``ignore_eos``) or at an EOS drawn with ``eos_probability``;
speculative strategies keep drafts at their ``simulated_acceptance_rate`` and the draft
model's passes are priced too; token trees (and chains, given ``tree_acceptance``) keep
the path drawn from a per-depth, per-rank acceptance table (``TreeAcceptance``), and a
tree of N nodes is verified, and priced, as N tokens. LoRA adapters are paged through
slots as the model executor pages them and priced by the cost model, batched or merged
one at a time (``simulated_lora.py``). With
``parallel.pipeline_parallel_size`` M, up to M steps are in flight, each stage busy for
its share of every step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from random import Random
from typing import List, Optional

import torch
from omegaconf import OmegaConf

from servelab.core.component import ComponentSpec
from servelab.core.cost_model import BatchShape, CostModel, CostModelContext
from servelab.core.decoding import DecodeResult, DecodingStrategy, lookahead_allowances
from servelab.core.errors import ConfigError
from servelab.core.executor import ExecutedStep, Executor, ExecutorContext
from servelab.core.kv_cache import KVCacheManager, KVCacheSpec
from servelab.core.kv_cache_dtype import SCALE_BYTES, is_quantized
from servelab.core.lora_registry import lora_enabled
from servelab.core.model import ModelShape
from servelab.core.outputs import Logprob
from servelab.core.quantization import WeightQuantization, weight_memory_bytes
from servelab.core.scheduler import SchedulerOutput
from servelab.plugins.executor.simulated_tree import TreeAcceptance, tree_shape


@dataclass
class SimulatedExecutorConfig:
    """``executor=simulated``: ``seed`` of the random tokens, EOS draws and draft
    acceptance; ``eos_probability``: the chance, per generated token, that a request which
    does not ignore EOS ends there (0: requests run to ``max_tokens``).

    ``tree_acceptance``: speculative acceptance by draft depth and rank,
    ``tree_acceptance[d][r]`` the chance that, with the path kept down to depth d (0: the
    first draft level), the target's next token is the draft's rank-r candidate there
    (each row sums to at most 1; depths past the last row use the last row, ranks past a
    row's end 0). Each step keeps, from the root, the child of that rank while the tree has
    it; a chain is the rank-0 column. None (the default): the strategy's
    ``simulated_acceptance_rate`` a as ``a (1 - a)^r`` at every depth, which keeps a
    chain's drafts at a each, as before, and tries every sibling at a.

    ``lora_serving`` (with ``lora.enabled``): ``batched``, a step's LoRA adapters applied
    unmerged in one pass through the slots as ``executor=model`` does; ``merged``, the
    baseline that merges one adapter at a time into the base weights
    (``simulated_lora.py``)."""

    seed: int = 0
    eos_probability: float = 0.0
    tree_acceptance: Optional[List[List[float]]] = None
    lora_serving: str = "batched"


@dataclass(frozen=True, slots=True)
class PricedStep:
    """A step in the simulated pipeline: when it leaves the last stage (``finish``), what
    it returns, and how long each stage worked on it."""

    finish: float
    output: SchedulerOutput
    result: DecodeResult | None
    stage_busy_s: tuple[float, ...]


class SimulatedExecutor(Executor):
    """Prices each step with the configured cost model and lets the engine's clock reach
    the time the step ends (a virtual clock jumps; a wall clock sleeps, so a server can
    pose as the simulated hardware)."""

    runs_model = False

    def __init__(self, config: SimulatedExecutorConfig, context: ExecutorContext):
        super().__init__(config, context)
        if not 0.0 <= config.eos_probability <= 1.0:
            raise ConfigError([f"executor.eos_probability must be in [0, 1], got {config.eos_probability}"])
        cfg = context.engine_cfg
        if OmegaConf.is_missing(cfg, "cost_model"):
            raise ConfigError(["executor=simulated needs a cost model: cost_model=roofline or cost_model=profiled"])
        self.hardware = OmegaConf.to_object(cfg.hardware)
        self.parallel = OmegaConf.to_object(cfg.parallel)
        self.element_bytes = context.dtype.itemsize
        self.cost_model = self._cost_model(context.shape, context.checkpoint.quantization)
        self.lora = None
        if lora_enabled(cfg.get("lora")):
            from servelab.plugins.executor.simulated_lora import SimulatedLoRA

            self.lora = SimulatedLoRA(cfg.lora, config.lora_serving, self.cost_model, context.shape,
                                      self.element_bytes, self.parallel.tensor_parallel_size,
                                      self.parallel.pipeline_parallel_size)
        self.max_steps_in_flight = self.parallel.pipeline_parallel_size
        self.random = Random(config.seed)
        tokenizer = context.checkpoint.tokenizer
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self.vocab_size = context.shape.vocab_size
        self.stage_free = [0.0] * self.parallel.pipeline_parallel_size
        self.draft_cost_model: CostModel | None = None
        self.acceptance = TreeAcceptance(config.tree_acceptance) if config.tree_acceptance is not None else None
        self.tree: tuple[list[tuple[int, ...]], list[int]] | None = None
        self._pending: deque[PricedStep] = deque()
        self._meta_caches: list[torch.Tensor] = []
        self._block_bytes = 0

    def _cost_model(self, shape: ModelShape, quantization: WeightQuantization | None = None) -> CostModel:
        cfg = self.context.engine_cfg
        bytes_ = self.element_bytes
        kv_spec = shape.kv_cache_spec(self.context.kv_dtype or self.context.dtype, self.context.max_model_len)
        kv_bytes = kv_spec.bytes_per_token / (kv_spec.kv_parts * kv_spec.num_layers * kv_spec.num_kv_heads * kv_spec.head_dim)
        return self.context.registry.build("cost_model", cfg.cost_model, CostModelContext(
            shape, self.hardware, self.parallel, weight_bytes=bytes_, kv_bytes=kv_bytes, activation_bytes=bytes_,
            quantization=quantization))

    def kv_cache_budget_bytes(self, spec: KVCacheSpec) -> int:
        """Device memory times ``memory_utilization``, less one device's share of the
        weights (at their stored width), of the LoRA adapter slots and the activation
        reserve."""
        hw, shape = self.hardware, self.context.shape
        weights = weight_memory_bytes(shape, self.context.checkpoint.quantization,
                                      self.element_bytes) / self.parallel.num_devices
        slots = self.lora.num_slots * self.lora.slot_bytes if self.lora is not None else 0
        usable = hw.memory_bytes * hw.memory_utilization
        left = usable - weights - slots - hw.activation_reserve_bytes
        if left < spec.bytes_per_token * spec.max_model_len:
            adapters = (f", {slots / 2**30:.1f} GiB of {self.lora.num_slots} LoRA adapter slots (lora.max_adapters or "
                        f"lora.memory_bytes)" if slots else "")
            raise ConfigError([
                f"the model does not fit hardware={hw.name}: {weights / 2**30:.1f} GiB of weights per device "
                f"({shape.num_parameters / 1e9:.1f}B parameters over {self.parallel.num_devices} device(s)){adapters} "
                f"and {hw.activation_reserve_bytes / 2**30:.1f} GiB of activations leave "
                f"{max(left, 0) / 2**30:.2f} GiB of the {usable / 2**30:.1f} GiB usable, less than one "
                f"{spec.max_model_len}-token sequence of KV cache needs; add devices "
                f"(parallel.tensor_parallel_size) or pick a larger device"])
        return int(left)

    def attach(self, cache: KVCacheManager, strategy: DecodingStrategy) -> None:
        """Keep the cache's block bytes for pricing block moves, the whole cache's shape
        for hand-offs, and a cost model for the strategy's draft model if it has one."""
        self.cache = cache
        self.strategy = strategy
        kv_dtype = self.context.kv_dtype or self.context.dtype
        self._block_bytes = self.context.shape.kv_cache_spec(
            kv_dtype, self.context.max_model_len, self.parallel.tensor_parallel_size,
            self.parallel.pipeline_parallel_size).block_bytes(cache.block_size, cache.groups)
        whole = self.context.shape.kv_cache_spec(kv_dtype, self.context.max_model_len)
        row = whole.head_dim + (SCALE_BYTES if is_quantized(kv_dtype) else 0)
        block = (cache.num_blocks, 2, cache.block_size, whole.num_kv_heads, row)
        self._meta_caches = [torch.empty(block, dtype=kv_dtype, device="meta") for _ in range(whole.num_layers)]
        if strategy.draft_model_shape is not None:
            self.draft_cost_model = self._cost_model(strategy.draft_model_shape)
        rate = getattr(strategy.config, "simulated_acceptance_rate", None)
        if self.acceptance is None and strategy.proposes_trees and rate is not None:
            self.acceptance = TreeAcceptance([[rate * (1 - rate) ** r for r in range(64)]])
        if self.acceptance is not None and strategy.num_lookahead_tokens:
            self.tree = tree_shape(strategy.config, self.acceptance)

    def add_lora(self, adapter) -> None:
        """Keep ``adapter``'s rank and projections for pricing (``InvalidRequestError`` on
        ``target_modules`` for one the model lacks); ``ConfigError`` without ``lora.enabled``."""
        if self.lora is None:
            raise ConfigError(["lora: this engine serves no LoRA adapters; set lora.enabled=true"])
        self.lora.add(adapter)

    def remove_lora(self, adapter) -> None:
        """Free ``adapter``'s slot."""
        if self.lora is not None:
            self.lora.remove(adapter)

    def lora_stats(self):
        """The simulated slots' paging counters (``LoRAStats``; None without LoRA), load
        seconds on the virtual clock."""
        return None if self.lora is None else self.lora.stats

    def lora_resident(self):
        """The load ids of the adapters in the simulated slots now."""
        return () if self.lora is None else self.lora.resident.keys()

    def evict_lora(self, load_id: int) -> None:
        """Free adapter ``load_id``'s slot (a unified pool took its pages back); its next
        use pages it in again."""
        if self.lora is not None and self.lora.resident.pop(load_id, None) is not None:
            self.lora.evictions += 1

    def local_kv_caches(self) -> list[torch.Tensor]:
        """The whole model's KV cache as it would be stored, with no storage: one meta
        tensor per layer (every pipeline stage's), ``[num_blocks, 2, block_size,
        num_kv_heads, head_dim]`` of the cache dtype (one-byte dtypes: ``head_dim`` + 4
        scale bytes per row), every KV head (the ranks' shares together), as the model's
        ``kv_cache_spec`` stores them (a latent attention: one head). A connector
        that handles meta caches (``kv_transfer=simulated``) reads the bytes a hand-off
        moves from them."""
        return self._meta_caches

    def shutdown(self) -> None:
        """Drop the cache's shapes; a simulated executor holds nothing else."""
        self._meta_caches = []

    # -- one step -------------------------------------------------------------------------------
    def submit(self, output: SchedulerOutput) -> None:
        """Decide the step's tokens and its place in the pipeline."""
        result, batch, allowances = self._decide(output)
        start = max(self.context.clock.now(), self.stage_free[0])
        start += self._block_moves_time(output) + self._draft_time(output, allowances)
        tier_io = self._lower_tier_time(output)
        stage_times: tuple[float, ...] = (0.0,) * len(self.stage_free)
        transfer = 0.0
        if output.scheduled:
            passes = self._passes(output, batch, allowances)
            start += sum(seconds for _, seconds in passes)
            costs = [self.cost_model.forward_cost(replace(shape, start_s=start)) for shape, _ in passes]
            stage_times = tuple(map(sum, zip(*(cost.stage_times for cost in costs))))
            transfer = max(cost.transfer_time for cost in costs)
        moment = start
        for stage, busy in enumerate(stage_times):
            begin = max(moment, self.stage_free[stage])
            self.stage_free[stage] = begin + busy
            moment = begin + busy + (transfer if stage + 1 < len(stage_times) else 0.0)
        moment = max(moment, start + tier_io)
        self._pending.append(PricedStep(moment, output, result, tuple(stage_times)))

    def collect(self) -> ExecutedStep:
        """Let the clock reach the end of the oldest step in flight; the step."""
        step = self._pending.popleft()
        self.context.clock.advance_to(step.finish)
        return ExecutedStep(step.output, step.result, step.stage_busy_s)

    @property
    def num_in_flight(self) -> int:
        """Steps priced and not collected."""
        return len(self._pending)

    def _decide(self, output: SchedulerOutput) -> tuple[DecodeResult | None, BatchShape, tuple[int, ...]]:
        """The step's tokens (drafts kept at the strategy's rate, random ids, EOS at
        ``eos_probability``) and the forward pass's shape."""
        sampling = output.sampling_requests
        speculative = self.strategy.num_lookahead_tokens > 0 and bool(sampling)
        allowances = lookahead_allowances(output, self.context.max_model_len) if speculative else (0,) * len(sampling)
        kept = self._kept_drafts(allowances) if speculative else None
        drafts = iter(allowances)
        query_lens, context_lens = [], []
        for grant in output.scheduled:
            extra = next(drafts) if grant.samples else 0
            query_lens.append(grant.num_new_tokens + extra)
            context_lens.append(grant.num_computed_tokens + grant.num_new_tokens + extra)
        batch = BatchShape(tuple(query_lens), tuple(context_lens), len(sampling) + sum(allowances))
        if not sampling:
            return None, batch, allowances
        counts = kept if kept is not None else [0] * len(sampling)
        token_ids = [self._tokens(request, count + 1) for request, count in zip(sampling, counts)]
        logprobs = None
        if any(r.sampling_params.logprobs is not None for r in sampling):
            uniform = -math.log(self.vocab_size)
            logprobs = [[{t: Logprob(t, uniform, 1)} for t in tokens] for tokens in token_ids]
        result = DecodeResult(token_ids, logprobs, allowances if kept is not None else None, kept)
        return result, batch, allowances

    def _passes(self, output: SchedulerOutput, batch: BatchShape,
                allowances: tuple[int, ...]) -> list[tuple[BatchShape, float]]:
        """The forward passes the step runs as, each with the seconds of adapter loads and
        merges before it: the whole batch in one, or with LoRA the passes
        ``SimulatedLoRA.passes`` gives (each with its requests' rows and its adapters)."""
        if self.lora is None:
            return [(batch, 0.0)]
        extras = iter(allowances)
        rows = [1 + next(extras) if grant.samples else 0 for grant in output.scheduled]
        return [(BatchShape(tuple(batch.query_lens[i] for i in chunk), tuple(batch.context_lens[i] for i in chunk),
                            sum(rows[i] for i in chunk), adapters=adapters), seconds)
                for chunk, seconds, adapters in self.lora.passes(output.scheduled, batch.query_lens)]

    def _kept_drafts(self, allowances: tuple[int, ...]) -> list[int] | None:
        """Drafts each request keeps: along the path ``self.acceptance`` draws through its
        tree (the first ``allowances[i]`` nodes of the shape; a chain: its rank-0 column),
        else at the strategy's own ``simulated_acceptance``."""
        if self.acceptance is None:
            return self.strategy.simulated_acceptance(allowances, self.random)
        paths = self.tree[0] if self.tree is not None else None
        return [self.acceptance.draw(set(paths[:a] if paths is not None else ((0,) * d for d in range(1, a + 1))),
                                     self.random) for a in allowances]

    def _tokens(self, request, count: int) -> list[int]:
        """``count`` random token ids, the first EOS drawn at ``eos_probability`` ending them."""
        eos = None if request.sampling_params.ignore_eos else self.eos_token_id
        tokens = []
        for _ in range(count):
            if eos is not None and self.random.random() < self.config.eos_probability:
                tokens.append(eos)
                break
            token = self.random.randrange(self.vocab_size)
            tokens.append(token if token != eos else (token + 1) % self.vocab_size)
        return tokens

    def _block_moves_time(self, output: SchedulerOutput) -> float:
        """Swapping and host-tier offloads and loads over the host link, copy-on-write
        within device memory."""
        swapped = len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in) + len(output.blocks_to_offload)
        if not swapped and not output.blocks_to_copy:
            return 0.0
        return (swapped * self._block_bytes / self.hardware.host_bandwidth
                + 2 * len(output.blocks_to_copy) * self._block_bytes / self.hardware.memory_bandwidth)

    def _lower_tier_time(self, output: SchedulerOutput) -> float:
        """The lower KV tier's saves and loads at ``hardware.disk_bandwidth`` after
        ``disk_latency_s``, overlapped with the step (its loads are used from the next
        one); they run through the cache with no content, every load succeeding."""
        blocks = len(output.blocks_to_spill) + len(output.blocks_to_fill)
        if not blocks:
            return 0.0
        self.cache.transfer_tier_blocks(output.blocks_to_spill, output.blocks_to_fill, None, None)
        return self.hardware.disk_latency_s + blocks * self._block_bytes / self.hardware.disk_bandwidth

    def _draft_time(self, output: SchedulerOutput, allowances: tuple[int, ...]) -> float:
        """The draft model's passes: a chain's one token per drafting request per drafted
        position; a tree's one pass per level, each request running the level's expanded
        nodes (``tree_shape``'s rows), batched over requests."""
        if self.draft_cost_model is None or not any(allowances):
            return 0.0
        contexts = [g.num_computed_tokens + 1 for g in output.scheduled if g.samples]
        drafting = [(c, a) for c, a in zip(contexts, allowances) if a]
        levels = self.tree[1] if self.tree is not None and self.tree[1] else None
        seconds = 0.0
        for position in range(len(levels) if levels else max(a for _, a in drafting)):
            if levels:
                queries = (levels[position],) * len(drafting)
                rows = [c + sum(levels[:position + 1]) for c, _ in drafting]
            else:
                rows = [c + position for c, a in drafting if a > position]
                queries = (1,) * len(rows)
            seconds += self.draft_cost_model.forward_cost(BatchShape(queries, tuple(rows), sum(queries))).total
        return seconds


SPEC = ComponentSpec("executor", "simulated", SimulatedExecutor, SimulatedExecutorConfig,
                     "prices every step with a cost model on a virtual clock; the real scheduler and cache, no model")
