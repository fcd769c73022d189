"""``executor=model``: runs the model's forward pass for every step (the default), on one
device (``device_worker.py``) or, with ``parallel.tensor_parallel_size`` /
``pipeline_parallel_size``, on several processes joined by ``torch.distributed``
(``distributed.py`` moves each step's inputs and outputs between them)."""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from servelab.core.batch_builder import PromptSpan, build_step_inputs, decode_step_inputs
from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, DecodingStrategy, lookahead_allowances
from servelab.core.errors import ConfigError
from servelab.core.executor import ExecutedStep, Executor, ExecutorContext
from servelab.core.expert_load import ExpertLoad
from servelab.core.kv_cache import KVCacheManager, KVCacheSpec
from servelab.core.kv_cache_dtype import kv_dtype_name
from servelab.core.lora_registry import lora_enabled
from servelab.core.model import ModelParallel
from servelab.core.engine.resolved_model import ResolvedModel
from servelab.core.scheduler import SchedulerOutput
from servelab.platform import (DEFAULT_MMAP_MAX, free_port, mmap_max_setter, retain_freed_heap_memory,
                               return_freed_heap_memory)
from servelab.plugins.executor.device_worker import DeviceWorker
from servelab.plugins.executor.distributed import (ATTACH, STOP, WARM_UP, Topology, WorkerSpec,
                                                   backend_for, default_threads, drive_torchrun,
                                                   join_group, local_world_size, pack_moves, pack_step,
                                                   send_header, torchrun_problems)
from servelab.plugins.executor.prompt_logprobs import prompt_logprobs
from servelab.plugins.executor.worker_group import WorkerGroup, WorkerProcess, describe_dead
from servelab.plugins.models.linear import release_padding_buffers
from servelab.plugins.models.moe import routed_pairs

CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
"""What a cache that sets no size gets on the CPU."""
INIT_METHODS = ("spawn", "env")
DEATH_REPORT_WAIT_S = 2.0
"""How long a failed collective waits for the dead worker's exit status, to name it."""


@dataclass
class ModelExecutorConfig:
    """``executor=model``: no options (the split is the top-level ``parallel`` node)."""


@dataclass(frozen=True, slots=True)
class PendingStep:
    """A submitted step: finished already (``executed``), or waiting for the last stage's
    logits (``batch``, ``proposal``, ``prompt_spans``, ``num_logits``)."""

    output: SchedulerOutput
    executed: ExecutedStep | None = None
    batch: DecodeBatch | None = None
    proposal: Any = None
    prompt_spans: tuple[PromptSpan, ...] = ()
    num_logits: int = 0


class ModelExecutor(Executor):
    """Owns this rank's share of the model, its attention backend and KV cache tensors
    (``worker``, a ``DeviceWorker``), and on several devices the worker processes
    (``worker_ranks``: their ranks, empty alone): builds each step's flat
    batch, sends it to the workers, runs the forward pass and lets the decoding strategy
    choose the tokens from the gathered logits. Models without weights (shape presets)
    are refused. ``shutdown`` (or collecting the executor, or interpreter exit) stops the
    workers and leaves the group (``WorkerGroup``); ``shutdown`` also drops the model and
    its KV tensors."""

    computes_prompt_logprobs = True
    runs_decode_steps = True

    def __init__(self, config: ModelExecutorConfig, context: ExecutorContext):
        super().__init__(config, context)
        registry, checkpoint, parallel_cfg = context.registry, context.checkpoint, context.engine_cfg.parallel
        topology = Topology(parallel_cfg.tensor_parallel_size, parallel_cfg.pipeline_parallel_size,
                            parallel_cfg.expert_parallel_size, parallel_cfg.expert_dispatch)
        spec = context.shape.attention_spec(context.dtype, context.device, context.max_model_len, topology.tp,
                                            context.kv_dtype)
        backend = registry.spec_for_config("attention", context.attention_config)
        problems = [f"attention={backend.name}: {reason}" for reason in
                    backend.cls.unsupported_reasons(OmegaConf.to_object(context.attention_config), spec)]
        if spec.kv_quantized and not backend.cls.reads_quantized_kv:
            problems.append(f"cache.kv_dtype={kv_dtype_name(context.engine_cfg.cache)}: attention={backend.name} "
                            f"does not read a quantized KV cache; use attention=auto, cpu, sdpa, naive or flash")
        if spec.values_are_keys and not backend.cls.reads_values_from_keys:
            problems.append(f"attention={backend.name} does not read values out of the keys, as "
                            f"{checkpoint.architecture}'s latent attention caches them (reads_values_from_keys "
                            f"is False); use attention=auto, cpu, sdpa, naive or flash")
        if checkpoint.weights is None:
            problems.append(f"the model ({checkpoint.architecture} shape, {context.shape.num_parameters / 1e9:.1f}B "
                            f"parameters) has no weights: executor=model runs checkpoints; use executor=simulated "
                            f"to simulate it")
        if parallel_cfg.threads is not None and parallel_cfg.threads < 1:
            problems.append(f"parallel.threads must be at least 1 (or null: this machine's cores shared out), "
                            f"got {parallel_cfg.threads}")
        if parallel_cfg.init_method not in INIT_METHODS:
            problems.append(f"parallel.init_method must be one of {', '.join(INIT_METHODS)}, "
                            f"got {parallel_cfg.init_method!r}")
        if problems:
            raise ConfigError(problems)
        self.device = context.device
        self.max_model_len = context.max_model_len
        self.topology = topology
        self.worker_ranks = range(1, topology.world_size)
        self.group = WorkerGroup(lambda ranks: send_header(STOP, ranks), topology.world_size)
        self._release = weakref.finalize(self, self.group.close)
        self._set_mmap_max = mmap_max_setter() if self.device.type == "cpu" else None  # around each step
        self._pending: deque[PendingStep] = deque()
        self._sends: list[Any] = []
        self.worker: DeviceWorker | None = None
        parallel = ModelParallel()
        try:
            if topology.world_size > 1:
                parallel = self._start_workers(parallel_cfg)
            elif parallel_cfg.threads:
                self.group.use_threads(parallel_cfg.threads)
            model = ResolvedModel(checkpoint=checkpoint, model_cls=context.model_cls, shape=context.shape,
                                  device=self.device, dtype=context.dtype, kv_dtype=context.kv_dtype,
                                  max_model_len=self.max_model_len)
            self.worker = DeviceWorker.load(registry, model, context.attention_config, parallel)
        except BaseException:
            self.shutdown()
            raise
        self.model, self.attention = self.worker.model, self.worker.attention
        self.max_steps_in_flight = topology.pp
        self.lora = None
        lora_cfg = context.engine_cfg.get("lora")
        if lora_enabled(lora_cfg):
            from servelab.plugins.executor.lora_slots import LoRASlots

            self.lora = LoRASlots(self.model, lora_cfg, context.dtype, self.device)
            if self.worker_ranks:
                from servelab.plugins.executor.lora_peers import LoRAPeers

                self.lora.peers = LoRAPeers(lambda header, payload: self._broadcast(header, payload))

    def add_lora(self, adapter: Any) -> None:
        """Check ``adapter`` against the model; it is paged into a slot when a step needs it."""
        if self.lora is None:
            raise ConfigError(["lora: this engine serves no LoRA adapters; set lora.enabled=true"])
        self.lora.check(adapter)

    def remove_lora(self, adapter: Any) -> None:
        """Free ``adapter``'s slot."""
        if self.lora is not None:
            self.lora.drop(adapter)

    def lora_stats(self) -> Any:
        """The adapter slots' paging counters (None without LoRA)."""
        return None if self.lora is None else self.lora.stats

    def lora_resident(self) -> Any:
        """The load ids of the adapters in the slots now."""
        return () if self.lora is None else self.lora.resident.keys()

    def evict_lora(self, load_id: int) -> None:
        """Free adapter ``load_id``'s slot (its weights stay until another adapter is
        written over them; its next use pages it in again)."""
        if self.lora is not None and self.lora.resident.pop(load_id, None) is not None:
            self.lora.evictions += 1

    def _start_workers(self, parallel_cfg: Any) -> ModelParallel:
        """Spawn ranks 1.. (or find them started by torchrun) and join the group as rank 0."""
        from servelab.core.config import resolved

        topology, group = self.topology, self.group
        if dist.is_initialized():
            raise ConfigError(["this process already belongs to a torch.distributed process group (another "
                               "parallel engine that was not shut down, or the program's own): call "
                               "LLM.shutdown() / LLMEngine.shutdown() on the engine, or destroy the group, first"])
        backend = backend_for(self.device, parallel_cfg.backend)
        cfg = resolved(self.context.engine_cfg)
        group.joined = True
        if parallel_cfg.init_method == "env":
            problems = torchrun_problems(topology)
            if problems:
                raise ConfigError(problems)
            group.use_threads(parallel_cfg.threads or default_threads(local_world_size(topology.world_size)))
            groups = drive_torchrun(topology, backend, cfg)
        else:
            threads = parallel_cfg.threads or default_threads(topology.world_size)
            group.use_threads(threads)
            init_method = f"tcp://127.0.0.1:{free_port()}"
            group.workers = [WorkerProcess.start(WorkerSpec(cfg, rank, topology, init_method, backend, threads))
                             for rank in self.worker_ranks]
            groups = join_group(topology, 0, init_method, backend)
        return topology.parallel(0, groups)

    @property
    def workers(self) -> list[WorkerProcess]:
        """The worker processes this executor started (none on one device or under torchrun)."""
        return self.group.workers

    def kv_cache_budget_bytes(self, spec: KVCacheSpec) -> int | None:
        """``CPU_KV_CACHE_BYTES`` on the CPU; on a GPU the free device memory times
        ``hardware.memory_utilization``."""
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * self.context.engine_cfg.hardware.memory_utilization)

    def attach(self, cache: KVCacheManager, strategy: DecodingStrategy) -> None:
        """Allocate every rank's KV cache tensors (and host pools, for swapping), after
        refusing a strategy that proposes token trees this engine cannot verify."""
        self.cache = cache
        self.strategy = strategy
        if strategy.proposes_trees:
            self._check_trees()
        if strategy.decode_steps > 1 and (self.topology.pp > 1 or self.lora is not None):
            raise ConfigError([f"decoding.multi_step={strategy.decode_steps}: multi-step decoding runs on one "
                               f"pipeline stage (parallel.pipeline_parallel_size=1) without LoRA adapters"])
        if strategy.reads_hidden_states and (self.topology.pp > 1 or self.lora is not None):
            raise ConfigError([f"decoding strategy {type(strategy).__name__} reads the target's hidden states: "
                               f"they are handed over on one pipeline stage (parallel.pipeline_parallel_size=1) "
                               f"without LoRA adapters"])
        if self.device.type == "cpu":
            retain_freed_heap_memory()
        sizes = (cache.num_blocks, cache.block_size, cache.num_host_blocks)
        self._to_workers(lambda: send_header(ATTACH, self.worker_ranks, (*sizes, len(cache.groups))))
        self.worker.allocate(*sizes, groups=cache.groups)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """This rank's per-layer KV cache tensors (none after ``shutdown``)."""
        return self.worker.kv_caches if self.worker is not None else []

    def local_kv_caches(self) -> list[torch.Tensor] | None:
        """The whole cache on one device, each layer viewed with its blocks first; None when
        ranks share the model."""
        if self.topology.world_size > 1 or self.worker is None:
            return None
        one, two = (self.attention.kv_cache_shape(n, self.cache.block_size) for n in (1, 2))
        block_axis = next(axis for axis, (a, b) in enumerate(zip(one, two)) if a != b)
        return [cache.movedim(block_axis, 0) for cache in self.kv_caches]


    def expert_load(self) -> ExpertLoad | None:
        """The pairs routed so far in this process's sparse layers (all of them on one
        device or under tensor and expert parallelism, where every rank routes every
        token; the first stage's under pipeline parallelism), per expert-parallel rank."""
        pairs = routed_pairs(self.worker.model) if self.worker is not None else {}
        return ExpertLoad(pairs, self.topology.ep) if pairs else None

    # -- steps ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, output: SchedulerOutput) -> None:
        """Move blocks, draft, build the flat batch, send it to the workers and run this
        rank's stage; the step's tokens come from ``collect``. On the CPU the step's blocks
        of every size come from the heap (glibc's ``M_MMAP_MAX`` 0 while it runs,
        ``servelab.platform.mmap_max_setter``)."""
        set_mmap_max = self._set_mmap_max
        if set_mmap_max is None:
            return self._submit(output)
        set_mmap_max(0)
        try:
            self._submit(output)
        finally:
            set_mmap_max(DEFAULT_MMAP_MAX)

    def _submit(self, output: SchedulerOutput) -> None:
        """``submit``'s work."""
        if output.blocks_to_spill or output.blocks_to_fill:
            self.cache.transfer_tier_blocks(output.blocks_to_spill, output.blocks_to_fill,
                                            self.worker.read_host_block, self.worker.write_host_block)
        moves = (output.blocks_to_offload, output.blocks_to_swap_in, output.blocks_to_swap_out, output.blocks_to_copy)
        if any(moves):
            self._broadcast(*pack_moves(moves))
            self.worker.move_blocks(moves)
        if not output.scheduled:
            self._pending.append(PendingStep(output, ExecutedStep(output, None)))
            return
        sampling = output.sampling_requests
        proposal = None
        if sampling and self.strategy.num_lookahead_tokens:
            allowance = lookahead_allowances(output, self.max_model_len, self.cache.block_size)
            proposal = self.strategy.propose(DecodeBatch(sampling, allowance, output))
        drafts = proposal.draft_token_ids if proposal is not None else ()
        inputs = build_step_inputs(output.scheduled, drafts, self.cache.block_size, self.device, prompt_logprobs=True)
        if proposal is not None and proposal.parents is not None:
            inputs = self._with_trees(inputs, output, proposal, allowance)
        if self.worker_ranks and self.lora is None:
            self._broadcast(*pack_step(inputs))
        started = time.perf_counter()
        counts = tuple(len(d) for d in drafts) if drafts else (0,) * len(sampling)
        batch = DecodeBatch(sampling, counts, output) if sampling else None
        if self.lora is not None:  # each forward pass is sent to the workers after its adapters' slots
            send = (lambda step: self._broadcast(*pack_step(step))) if self.worker_ranks else None
            stages = None
            if self.topology.pp > 1:
                from servelab.plugins.executor.pipeline_pass import PipelinePass

                stages = PipelinePass(self.worker, self.topology, self.context.shape.vocab_size)
            logits, spans = self._guarded(lambda: self.lora.logits(stages or self.worker, output.scheduled, drafts,
                                                                   self.cache.block_size, send))
            busy = (time.perf_counter() - started,) if stages is None else tuple(stages.busy_s.tolist())
            executed = self._finished(output, logits, batch, proposal, spans, busy)
            self._pending.append(PendingStep(output, executed))
            return
        if self.topology.pp == 1:
            steps = self._decode_steps(output, batch) if self.strategy.decode_steps > 1 and batch else 1
            result = logits = hidden = None
            if steps > 1:
                result = self._run_ahead(output, inputs, batch, steps)
            elif self._greedy_decode_step(output, inputs, batch, proposal):
                tokens, logits = self._guarded(lambda: self.worker.greedy_tokens_or_logits(inputs))
                result = None if tokens is None else DecodeResult(tokens.t().tolist())
            if result is not None:
                self._pending.append(PendingStep(output, ExecutedStep(output, result,
                                                                      (time.perf_counter() - started,))))
                return
            if self.strategy.reads_hidden_states:
                hidden, logits = self._guarded(lambda: self.worker.hidden_and_logits(inputs))
            elif logits is None:
                logits = self._guarded(lambda: self.worker.logits(inputs))
            executed = self._finished(output, logits, batch, proposal, inputs.prompt_spans,
                                      (time.perf_counter() - started,), hidden)
            self._pending.append(PendingStep(output, executed))
            return
        hidden = self._guarded(lambda: self.worker.forward(inputs.input_ids, inputs.positions, inputs.layouts))
        stage_times = torch.zeros(self.topology.pp, dtype=torch.float64)
        stage_times[0] = time.perf_counter() - started
        carried = [t.contiguous() for t in (*hidden, stage_times)]
        self._to_workers(lambda: self._sends.extend((dist.isend(t, self.topology.next_rank(0)), t) for t in carried))
        self._pending.append(PendingStep(output, batch=batch, proposal=proposal, prompt_spans=inputs.prompt_spans,
                                         num_logits=inputs.logits_indices.numel()))

    def _decode_steps(self, output: SchedulerOutput, batch: DecodeBatch) -> int:
        """Model steps this scheduled step runs: 1 unless every grant decodes one sampled
        token and the strategy chooses the batch's tokens from their logits alone; then up
        to its ``decode_steps``, cut at the lookahead slots every request holds and at the
        tokens each may still generate (``max_tokens``)."""
        if len(batch.requests) != len(output.scheduled) or not self.strategy.runs_ahead(batch.requests):
            return 1
        steps = 1 + min(lookahead_allowances(output, self.max_model_len, self.cache.block_size))
        for request in batch.requests:
            if request.sampling_params.max_tokens is not None:
                steps = min(steps, request.sampling_params.max_tokens - request.num_output_tokens)
        return max(steps, 1)

    def _plain_argmax(self, batch: DecodeBatch) -> bool:
        """True when the model may choose the batch's tokens itself (``greedy_steps``): one
        rank, and the strategy answers every request, all ``plain_argmax``, with the argmax."""
        return (not self.worker_ranks and self.strategy.takes_plain_argmax
                and all(r.sampling_params.plain_argmax for r in batch.requests))

    def _greedy_decode_step(self, output: SchedulerOutput, inputs: Any, batch: DecodeBatch | None,
                            proposal: Any) -> bool:
        """True for a single step whose tokens the model may choose in its call: every grant
        a one-token decode (no prompt rows, no draft) of a ``_plain_argmax`` batch, for a
        strategy that reads no hidden states."""
        return (batch is not None and proposal is None and not self.strategy.reads_hidden_states
                and len(batch.requests) == len(output.scheduled) and inputs.logits_are_all_rows
                and self._plain_argmax(batch))

    def _run_ahead(self, output: SchedulerOutput, inputs: Any, batch: DecodeBatch, steps: int) -> DecodeResult:
        """Multi-step decoding: ``steps`` forward passes over the batch, each fed the tokens
        the strategy chose from the pass before, their KV written into the lookahead slots;
        each request's tokens in order (the scheduler's stop conditions cut them)."""
        if self._plain_argmax(batch):
            tokens = self._guarded(lambda: self.worker.greedy_steps(inputs, steps))
            if tokens is not None:  # the model ran every step in one go
                return DecodeResult(tokens.t().tolist())
        token_ids: list[list[int]] = [[] for _ in batch.requests]
        logprobs: list[list[Any]] | None = None
        for ahead in range(steps):
            if ahead:
                inputs = decode_step_inputs(output.scheduled, self.cache.block_size, self.device, ahead,
                                            [tokens[-1] for tokens in token_ids])
                if self.worker_ranks:
                    self._broadcast(*pack_step(inputs))
            result = self.strategy.accept(self._guarded(lambda: self.worker.logits(inputs)), batch, None)
            for tokens, chosen in zip(token_ids, result.token_ids):
                tokens += chosen
            if result.logprobs is not None:
                logprobs = logprobs or [[] for _ in batch.requests]
                for entries, chosen in zip(logprobs, result.logprobs):
                    entries += chosen
        return DecodeResult(token_ids, logprobs)

    def _finished(self, output: SchedulerOutput, logits: torch.Tensor | None, batch: DecodeBatch | None,
                  proposal: Any, spans: tuple[PromptSpan, ...], stage_busy_s: tuple[float, ...],
                  hidden: torch.Tensor | None = None) -> ExecutedStep:
        """The step's result from its logits: the leading rows give the prompt logprobs,
        the decoding strategy chooses tokens from the rest (and gets the kept tokens'
        ``hidden`` states when it reads them)."""
        num_prompt = sum(span.count for span in spans)
        computed = prompt_logprobs(logits[:num_prompt], spans) if num_prompt else ()
        result = None if batch is None else self.strategy.accept(logits[num_prompt:], batch, proposal)
        if result is not None and result.accepted_nodes is not None:
            self._keep_paths(output, result.accepted_nodes)
        if hidden is not None:
            from servelab.core.hidden_states import kept_hidden_states

            drafts = proposal.draft_token_ids if proposal is not None else ()
            self.strategy.observe_hidden_states(kept_hidden_states(output, hidden, drafts, result))
        return ExecutedStep(output, result, stage_busy_s, computed)

    def _with_trees(self, inputs: Any, output: SchedulerOutput, proposal: Any, allowances: tuple[int, ...]) -> Any:
        """The step's inputs with the proposal's token trees laid out (``core/token_tree.py``)."""
        from servelab.core.token_tree import verified_tree_inputs

        self._check_trees()
        return verified_tree_inputs(inputs, output, proposal, allowances, type(self.strategy).__name__)

    def _check_trees(self) -> None:
        """Raise ``ConfigError`` with every reason this engine cannot verify token trees."""
        from servelab.core.attention import AttentionBackend

        problems = []
        if self.topology.world_size > 1:
            problems.append("token trees are verified on one device (parallel.*_size = 1)")
        if self.lora is not None:
            problems.append("token trees are not verified with LoRA adapters")
        if (len(self.cache.groups) > 1 or not isinstance(self.attention, AttentionBackend)
                or self.attention.spec.sliding_window is not None):
            problems.append("token trees need a model whose layers all attend to the whole context")
        elif not self.attention.reads_token_trees:
            problems.append(f"attention backend {type(self.attention).__name__} does not mask token trees "
                            f"(reads_token_trees is False); use attention=cpu, sdpa, naive or flash")
        if problems:
            raise ConfigError([f"decoding strategy {type(self.strategy).__name__}: {p}" for p in problems])

    def _keep_paths(self, output: SchedulerOutput, accepted_nodes: list[list[int]]) -> None:
        """Move each request's kept path of tree nodes into the slots after its last token
        in every layer's cache; the scheduler then truncates the rest."""
        from servelab.core.token_tree import kept_path_slots

        sources, destinations = kept_path_slots(output, accepted_nodes, self.cache.block_size)
        if sources:
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(destinations, device=self.device)
            for cache in self.worker.block_tensors:
                self.attention.copy_slots(cache, src, dst)

    def collect(self) -> ExecutedStep:
        """The oldest step: finished at submit (one stage), or finished by the logits and
        the stages' busy times the last stage sends back."""
        step = self._pending.popleft()
        if step.executed is not None:
            return step.executed
        root = self.topology.last_stage_root
        logits = None
        if step.num_logits:
            logits = torch.empty(step.num_logits, self.context.shape.vocab_size, dtype=torch.float32)
            self._to_workers(lambda: dist.recv(logits, root))
        stage_times = torch.zeros(self.topology.pp, dtype=torch.float64)
        self._to_workers(lambda: dist.recv(stage_times, root))
        return self._finished(step.output, logits, step.batch, step.proposal, step.prompt_spans,
                              tuple(stage_times.tolist()))

    @property
    def num_in_flight(self) -> int:
        """Steps submitted and not collected."""
        return len(self._pending)

    def _broadcast(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        """Send a header and its payload to every worker without waiting for them to
        receive (a pipeline stage may still be busy with an earlier step, whose logits it
        can only hand over once this rank collects them); the sends of the step before
        (received by now: the engine keeps at most ``pp`` steps in flight) are completed
        first. ``_sends`` keeps (handle, tensor) pairs so the tensors outlive the sends."""
        def send():
            for handle, _ in self._sends:
                handle.wait()
            self._sends = [(dist.isend(tensor, rank), tensor) for rank in self.worker_ranks
                           for tensor in (header, payload)]
        self._to_workers(send)

    def _to_workers(self, operation: Any) -> Any:
        """Run a send or receive to the workers (nothing alone), ``_guarded``."""
        if not self.worker_ranks:
            return None
        return self._guarded(operation)

    def _guarded(self, operation: Any) -> Any:
        """Run ``operation`` (anything that talks to the other ranks, a forward pass with
        its all-reduces included); if a worker process has died, raise at once naming it."""
        if not self.worker_ranks:
            return operation()
        dead = describe_dead(self.workers)
        if dead:
            raise RuntimeError(f"a parallel worker exited: {dead}")
        try:
            return operation()
        except RuntimeError as exc:
            deadline = time.monotonic() + DEATH_REPORT_WAIT_S
            while not describe_dead(self.workers) and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = describe_dead(self.workers) or "a rank of the group"
            raise RuntimeError(f"a parallel worker exited: {dead} ({exc})") from exc

    def warm_up(self, max_tokens: int) -> int:
        """Every rank's kernels for steps of up to ``max_tokens`` tokens (CPU matmuls)."""
        self._to_workers(lambda: send_header(WARM_UP, self.worker_ranks, (max_tokens,)))
        return self.model.warm_up(max_tokens)

    def shutdown(self) -> None:
        """Stop the workers, leave the group, restore the torch thread count, drop the
        model and its KV tensors and give the freed heap back; calling it again does
        nothing."""
        self._release()
        self._pending.clear()
        self._sends = []
        if self.worker is not None:
            self.worker.release()
            self.worker = self.model = self.attention = self.lora = None
            if self.device.type == "cpu":
                release_padding_buffers()
                return_freed_heap_memory()

SPEC = ComponentSpec("executor", "model", ModelExecutor, ModelExecutorConfig,
                     "runs the model's forward pass for every step, on one device or several (default)")
