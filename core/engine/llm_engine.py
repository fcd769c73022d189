"""The engine loop: validated requests in, one scheduled step at a time, outputs out."""

from __future__ import annotations

import itertools
import math
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf

from servelab.core.clock import Clock, VirtualClock, WallClock
from servelab.core.config import expert_dispatch_problems
from servelab.core.decoding import DecodingContext
from servelab.core.deployment import ROLES
from servelab.core.errors import ConfigError, EngineShutdownError, InvalidRequestError
from servelab.core.executor import ExecutedStep, ExecutorContext
from servelab.core.kv_transfer import HandOff, KVTransfer, TransferTicket
from servelab.core.kv_cache import NO_TIER_MOVES, CacheContext
from servelab.core.lora_registry import LoRARegistry, lora_enabled
from servelab.core.kv_tier import kv_fingerprint
from servelab.core.engine.output_processor import OUTPUT_KINDS, OutputProcessor
from servelab.core.outputs import RequestOutput
from servelab.core.policy import PolicyContext, SLOClass
from servelab.core.quantization import quantization_problems
from servelab.core.engine.registry import Registry, get_registry
from servelab.core.request import Request
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.engine.resolved_model import ResolvedModel
from servelab.core.sampling_params import SamplingParams
from servelab.core.scheduler import SchedulerContext, SchedulerOutput, SchedulerUpdate
from servelab.core.step_stats import StepStats
from servelab.core.stop_checker import StopChecker
from servelab.core.engine.validate import validate

log = logging.getLogger(__name__)

T = TypeVar("T")


def _prefilled(request: Request) -> bool:
    """True for a running sequence whose prefill is done: a token generated, every token
    but the newest cached."""
    return request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1


def _plain(config: object) -> object:
    """A config node as plain Python containers (a plain value passes through)."""
    return OmegaConf.to_container(config) if OmegaConf.is_config(config) else config


def build_collecting(problems: list[str], build: Callable[[], T]) -> T | None:
    """``build()``, or None with its ``ConfigError``'s problems added to ``problems``, so
    one error can report every component's problems together."""
    try:
        return build()
    except ConfigError as exc:
        problems += exc.problems
        return None


def decode_steps_problems(strategy: Any, executor_cls: type) -> list[str]:
    """Why ``strategy``'s multi-step decoding (``decode_steps > 1``) cannot run here."""
    if strategy.decode_steps == 1:
        return []
    if strategy.num_lookahead_tokens:
        return [f"decoding.multi_step={strategy.decode_steps}: {type(strategy).__name__} also drafts tokens "
                f"(num_lookahead_tokens={strategy.num_lookahead_tokens}); multi-step decoding takes one "
                f"token a model step"]
    if not executor_cls.runs_decode_steps:
        return [f"decoding.multi_step={strategy.decode_steps}: executor {executor_cls.__name__} runs one model "
                f"step per scheduled step (runs_decode_steps is False); use executor=model"]
    return []


class LLMEngine:
    """Builds every component from a composed config and runs the step loop.

    ``registry`` (default: the process-wide one) is the registry every component is
    built from, the engine's own components and the ones they build (a draft model, an
    eviction policy). ``clock`` (default: a virtual clock for an executor that runs no
    model, else the wall clock) is the only time the engine and its scheduler read. Each
    component validates its own config; the engine reports every problem of every
    component in one ``ConfigError`` before anything runs.

    ``shutdown`` releases everything the engine holds (worker processes, the process
    group, the model, KV tensors, the draft model); dropping the last reference does the
    same, through the executor's finalizer. After it, every call raises
    ``EngineShutdownError``.
    """

    def __init__(self, cfg: DictConfig, registry: Registry | None = None, clock: Clock | None = None):
        self.cfg = cfg
        self.registry = registry = registry or get_registry()
        executor_cls = registry.spec_for_config("executor", cfg.executor).cls
        self.clock = clock or (WallClock() if executor_cls.runs_model else VirtualClock())
        resolved = ResolvedModel.of(cfg, registry, executor_cls.runs_model)
        checkpoint, model_cls, shape = resolved.checkpoint, resolved.model_cls, resolved.shape
        kv_dtype = resolved.kv_dtype
        self.tokenizer = checkpoint.tokenizer
        self.quantization = checkpoint.quantization
        self.device, self.dtype, self.shape = resolved.device, resolved.dtype, shape
        self.max_model_len = resolved.max_model_len
        self.vocab_size = shape.vocab_size
        problems = list(resolved.problems)
        if cfg.get("role", "mixed") not in ROLES:
            problems.append(f"role must be one of {', '.join(ROLES)}, got {cfg.role!r}")
        attention_spec = shape.attention_spec(self.dtype, self.device, self.max_model_len, kv_dtype=kv_dtype)
        cfg.attention = registry.spec_for_config("attention", cfg.attention).cls.resolve(
            cfg.attention, attention_spec, registry)
        parallel = cfg.parallel
        problems += shape.parallel_problems(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                            parallel.expert_parallel_size)
        problems += expert_dispatch_problems(parallel)
        if cfg.cache.get("lower_tier") and parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            problems.append("cache.lower_tier runs its I/O in the engine's process: it needs "
                            "parallel.tensor_parallel_size=1 and parallel.pipeline_parallel_size=1")
        problems += quantization_problems(checkpoint.quantization, shape, parallel.tensor_parallel_size, self.device,
                                          executor_cls.runs_model)
        executor = None if problems else build_collecting(problems, lambda: registry.build(
            "executor", cfg.executor, ExecutorContext(checkpoint, shape, model_cls, self.dtype, self.device,
                                                      self.max_model_len, cfg.attention, cfg, registry, self.clock,
                                                      kv_dtype)))
        kv_spec = shape.kv_cache_spec(kv_dtype, self.max_model_len, parallel.tensor_parallel_size,
                                      parallel.pipeline_parallel_size)
        budget = build_collecting(problems, lambda: executor.kv_cache_budget_bytes(kv_spec)) if executor else None
        fingerprint = ""  # only a tier that outlives the engine needs it
        if cfg.cache.get("lower_tier"):
            fingerprint = kv_fingerprint(checkpoint.source, checkpoint.hf_config, {
                "kv": repr(kv_spec), "dtype": str(self.dtype), "quantization": repr(checkpoint.quantization),
                "seed": cfg.model.get("seed"), "attention": type(cfg.attention).__name__})
        cache = build_collecting(problems, lambda: registry.build(
            "cache", cfg.cache, CacheContext(kv_spec, registry, budget, fingerprint))) if executor else None
        strategy = build_collecting(problems, lambda: registry.build("decoding", cfg.decoding, DecodingContext(
            registry, self.device, self.dtype, self.vocab_size, self.max_model_len, self.tokenizer, cfg.attention,
            executor_cls.runs_model, checkpoint)))
        self.stop_checker = StopChecker(self.tokenizer, self.max_model_len)
        self.slo_classes, slo_problems = SLOClass.parse(_plain(cfg.get("slo_classes") or {}))
        problems += slo_problems
        policy_cfg = cfg.get("policy")
        self.policy = build_collecting(problems, lambda: registry.build(
            "policy", policy_cfg, PolicyContext(self.clock, self.slo_classes))) if policy_cfg is not None else None
        lora_cfg = cfg.get("lora")
        self.adapter_admission = None
        """With LoRA, the adapter-aware admission (``AdapterAdmission``; its ``pool``: the
        unified pool, when ``lora.unified_pool``)."""
        if cache is not None and lora_enabled(lora_cfg):
            self.adapter_admission = build_collecting(problems, lambda: self._adapter_admission(
                lora_cfg, executor, cache, kv_spec))
        scheduler = None
        if strategy is not None:
            problems += decode_steps_problems(strategy, executor_cls)
        if cache is not None and strategy is not None:
            lookahead = strategy.num_lookahead_tokens + strategy.decode_steps - 1
            scheduler = build_collecting(problems, lambda: registry.build("scheduler", cfg.scheduler, SchedulerContext(
                cache, self.max_model_len, lookahead, self.stop_checker,
                strategy.on_request_finished, self.clock, self.policy, self.adapter_admission)))
        self.lora = build_collecting(problems, lambda: LoRARegistry.of(lora_cfg, executor)) if (
            executor is not None and lora_enabled(lora_cfg)) else None
        problems += validate(self.max_model_len, shape.max_positions, cache, kv_spec, cfg.get("role", "mixed"))
        if problems:
            for built in (executor, strategy, cache):
                if built is not None:
                    built.shutdown()
            raise ConfigError(problems)
        self.cache, self.strategy, self.scheduler, self.executor = cache, strategy, scheduler, executor
        executor.attach(cache, strategy)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.is_shut_down = False
        self.hooks = registry.hook
        self.hooks.servelab_engine_started(engine=self)

    def _adapter_admission(self, lora_cfg: Any, executor: Any, cache: Any, kv_spec: Any) -> Any:
        """The LoRA admission (and unified pool) ``lora_cfg`` asks for over ``executor``'s
        slots and ``cache``'s blocks (core/lora_admission.py)."""
        import torch

        from servelab.core.lora_admission import adapter_admission

        if executor.lora_stats() is None:
            return None  # the registry refuses this executor, naming it
        block_bytes = kv_spec.block_bytes(cache.block_size, cache.groups or None)
        return adapter_admission(lora_cfg, executor, cache, block_bytes,
                                 torch.empty((), dtype=self.dtype).element_size(),
                                 self.cfg.parallel.tensor_parallel_size, self.max_model_len)

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (token-id prompts pass through)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def _ensure_running(self, operation: str) -> None:
        """Raise ``EngineShutdownError`` for ``operation`` once the engine is shut down."""
        if self.is_shut_down:
            raise EngineShutdownError(operation)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      max_tokens_must_fit: bool = False) -> None:
        """Raise ``InvalidRequestError`` naming the field and the limit if the request
        cannot be served; nothing enters the engine. ``max_tokens_must_fit`` (the OpenAI
        server's rule) also refuses a prompt whose ``max_tokens`` would run past
        ``max_model_len`` (otherwise generation stops there, finish reason ``length``)."""
        self._ensure_running("check_request")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            bad = next(t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size)
            raise InvalidRequestError("prompt_token_ids", f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError("logit_bias", f"token id {max(params.logit_bias)} is outside the vocabulary "
                                                    f"[0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", (
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(prompt_token_ids)} tokens (at most {self.max_model_len - 1}, so that one can be generated)"))
        if params.prompt_logprobs is not None and not self.executor.computes_prompt_logprobs:
            raise InvalidRequestError("prompt_logprobs", f"executor={self._executor_name()} does not compute prompt "
                                                         f"logprobs")
        self.strategy.check_request(params)
        limit = self.scheduler.max_num_seqs()
        if params.n > 1 and limit is not None and params.n > limit and self.cache.supports_fork:
            raise InvalidRequestError("n", f"{params.n} sequences share their prompt and run together, but "
                                           f"scheduler.max_num_seqs={limit}")
        if params.use_beam_search:
            raise InvalidRequestError("use_beam_search", (
                "beam search runs over the engine, not inside it: use LLM.generate or "
                "servelab.BeamSearch(engine); LLMEngine.add_request generates sampled sequences"))
        if (max_tokens_must_fit and params.max_tokens is not None
                and len(prompt_token_ids) + params.max_tokens > self.max_model_len):
            raise InvalidRequestError("max_tokens", (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_token_ids) + params.max_tokens} tokens ({len(prompt_token_ids)} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the prompt or completion."))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, output_kind: str = "final",
                    max_tokens_must_fit: bool = False, metadata: RequestMetadata | None = None,
                    cache_salt: str | None = None, lora: str | None = None) -> str:
        """Validate (``check_request``, ``check_metadata``) and queue a prompt; returns its
        request id. ``output_kind``: final | cumulative | delta (see ``OutputProcessor``);
        ``metadata``: its priority, tenant, deadline and SLO class, for the policy;
        ``cache_salt``: prefix caching reuses only blocks cached under the same salt (1 to
        256 characters; None shares with every request without one); ``lora``: the name of a
        loaded LoRA adapter to run it with (None: the base model)."""
        self._ensure_running("add_request")
        params = params or SamplingParams()
        metadata = metadata or NO_METADATA
        if output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        token_ids = self.tokenize(prompt)
        self.check_request(token_ids, params, max_tokens_must_fit)
        seconds_left = self.check_metadata(metadata)
        if cache_salt is not None and not (isinstance(cache_salt, str) and 1 <= len(cache_salt) <= 256):
            raise InvalidRequestError("cache_salt", f"must be a string of 1 to 256 characters, got {cache_salt!r}")
        adapter = self.lora_adapter(lora) if lora is not None else None
        if adapter is not None:
            cache_salt = adapter.salted(cache_salt)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.outputs.groups:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        arrival = self.clock.now() if arrival_time is None else arrival_time
        deadline_time = None if seconds_left is None else self.clock.now() + seconds_left
        text = prompt if isinstance(prompt, str) else None
        children = [self._child(request_id, i, token_ids, params, arrival, text, metadata, deadline_time)
                    for i in range(params.n)]
        if self.policy is not None and not self.policy.passive:
            self.policy.check_request(children[0])
        for child in children:
            child.cache_salt, child.lora = cache_salt, adapter
        self._queue(request_id, children, output_kind)
        self.num_prompt_tokens += len(token_ids) * len(children)
        return request_id

    def lora_adapter(self, name: str) -> Any:
        """The LoRA adapter loaded as ``name`` (``LoRAAdapter``); ``InvalidRequestError`` on
        ``lora`` when there is none or the engine serves no adapters."""
        if self.lora is None:
            raise InvalidRequestError("lora", f"this engine serves no LoRA adapters (asked for {name!r}): start it "
                                              f"with lora.enabled=true or lora.adapters")
        adapter = self.lora.get(name)
        if self.adapter_admission is not None and self.adapter_admission.pool is not None:
            self.adapter_admission.pool.check(adapter)
        return adapter

    def load_lora_adapter(self, name: str, path: str | None) -> None:
        """Serve the adapter store's (``lora.store``) adapter at ``path`` as ``name`` from
        the next request on (``path`` None: the store's adapter named ``name``; the default
        store reads the PEFT folder ``path``); ``InvalidRequestError`` naming the field
        when it cannot (docs/lora.md)."""
        self._ensure_running("load_lora_adapter")
        if self.lora is None:
            raise InvalidRequestError("lora_name", "this engine serves no LoRA adapters: start it with "
                                                   "lora.enabled=true")
        self.lora.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests naming it are refused, running ones
        finish with it."""
        self._ensure_running("unload_lora_adapter")
        if self.lora is None:
            raise InvalidRequestError("lora_name", f"unknown LoRA adapter {name!r}: this engine serves none")
        adapter = self.lora.unload(name)
        if self.adapter_admission is not None and self.adapter_admission.pool is not None:
            self.adapter_admission.pool.drop(adapter)

    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters: name to where its store read it (empty without LoRA)."""
        return {} if self.lora is None else {name: a.path for name, a in self.lora.adapters.items()}

    def _queue(self, request_id: str, children: list[Request], output_kind: str) -> None:
        """Track a request's sequences for output and hand them to the scheduler (forks
        share the first sequence's prompt blocks when the cache can fork)."""
        self._track(request_id, children, output_kind)
        if len(children) > 1 and self.cache.supports_fork:
            children[0].forks = children[1:]
            self.scheduler.add_request(children[0])
        else:
            for child in children:
                self.scheduler.add_request(child)

    def _track(self, request_id: str, children: list[Request], output_kind: str) -> None:
        """Render the sequences' outputs as ``output_kind`` (incremental text where needed)."""
        self.outputs.add(request_id, children, output_kind)
        for child in children:
            if output_kind != "final" or child.sampling_params.stop_strings:
                self.stop_checker.attach_detokenizer(child)

    def check_metadata(self, metadata: RequestMetadata) -> float | None:
        """Raise ``InvalidRequestError`` for an SLO class this engine does not define or a
        deadline already past; returns the seconds left until the deadline (None: none)."""
        if metadata.slo_class is not None and metadata.slo_class not in self.slo_classes:
            defined = ", ".join(sorted(self.slo_classes)) or "none (set slo_classes)"
            raise InvalidRequestError("slo_class", f"unknown SLO class {metadata.slo_class!r}; this engine defines: "
                                                   f"{defined}")
        if metadata.deadline is None:
            return None
        now = time.time()
        if metadata.deadline <= now:
            raise InvalidRequestError("deadline", f"{metadata.deadline} is in the past ({now - metadata.deadline:.3f} s "
                                                  f"before now, {now:.3f} s since the Unix epoch)")
        return metadata.deadline - now

    def _child(self, request_id: str, index: int, token_ids: list[int], params: SamplingParams,
               arrival: float, text: str | None, metadata: RequestMetadata = NO_METADATA,
               deadline_time: float | None = None) -> Request:
        child_params = params
        if params.n > 1:
            child_params = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
        child_id = request_id if params.n == 1 else f"{request_id}#{index}"
        return Request(child_id, token_ids, child_params, self._eos_token_id(), text, arrival, index, request_id,
                       metadata, deadline_time)

    def _eos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def abort_request(self, request_ids: list[str] | str) -> None:
        """Abort prompts by id; their cache is freed at once."""
        self._ensure_running("abort_request")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.abort(self.outputs.child_ids(ids))
        for rid in ids:
            self.outputs.groups.pop(rid, None)

    # -- disaggregation: a request's KV from a prefill engine to a decode engine --------------
    def ready_to_hand_off(self) -> list[str]:
        """Requests whose every sequence has finished its prefill (one token or more
        generated, all but the newest cached) or stopped, and one or more runs on: what a
        prefill instance hands off after a step."""
        return [request_id for request_id, group in self.outputs.groups.items()
                if not group.finished and all(c.is_finished or _prefilled(c) for c in group.children)]

    def hand_off(self, request_id: str, connector: KVTransfer) -> tuple[TransferTicket, ...]:
        """Publish a running request's KV cache and state through ``connector`` and drop
        it here; returns one ticket per sequence (``n`` of them; one that already stopped
        carries no blocks), which a decode engine continues the request from
        (``admit_handed_off``). ``InvalidRequestError`` naming the problem unless it is
        ``ready_to_hand_off``; the request keeps running then, as it does when a send fails."""
        self._ensure_running("hand_off")
        group = self.outputs.groups.get(request_id)
        if group is None:
            raise InvalidRequestError("request_id", f"{request_id!r} is not running here")
        for request in group.children:
            if not (request.is_finished or _prefilled(request)):
                raise InvalidRequestError("request_id", (
                    f"{request.request_id!r} cannot be handed off now: it has {request.num_output_tokens} generated "
                    f"tokens and {request.num_computed_tokens} of {request.num_tokens} tokens cached (a hand-off "
                    f"follows its prefill: one token or more generated, all but the newest cached, no step in flight)"))
        caches = self._local_kv_caches(connector)
        tickets: list[TransferTicket] = []
        try:
            for i, request in enumerate(group.children):
                blocks = [] if request.is_finished else self.cache.block_table(request)[
                    :math.ceil(request.num_computed_tokens / self.cache.block_size)]
                handoff = HandOff.of(request, len(group.children), group.sent_tokens[i], group.sent_chars[i],
                                     group.sent_prompt_logprobs)
                tickets.append(connector.send(caches, blocks, handoff))
        except BaseException:
            for ticket in tickets:
                connector.abort(ticket)
            raise
        self.abort_request(request_id)
        return tuple(tickets)

    def admit_handed_off(self, tickets: Sequence[TransferTicket], connector: KVTransfer,
                         output_kind: str = "final") -> str | None:
        """Continue a request another engine handed off (every ticket ``hand_off``
        returned): take blocks for its cached tokens, receive its KV into them through
        ``connector`` and queue it to decode; returns its request id, or None with nothing
        changed when the cache has no room yet (the tickets stay valid: admit them again
        after steps free blocks). Its outputs start from its first token; as ``delta``,
        after what the sender's delta outputs already gave. The request is
        checked as ``add_request`` checks a prompt (and runs with this engine's LoRA adapter
        of the sender's adapter's name); a failed transfer frees its blocks, drops the other
        tickets and raises ``KVTransferError``."""
        self._ensure_running("admit_handed_off")
        if output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        handoffs = [ticket.handoff for ticket in tickets]
        first = handoffs[0] if handoffs else None
        if first is None or sorted(h.index for h in handoffs) != list(range(first.num_sequences)) or any(
                h.group != first.group for h in handoffs):
            raise InvalidRequestError("tickets", "must be every ticket of one hand-off (one per sequence)")
        group_id = first.group
        self.check_request(list(first.token_ids[:first.num_prompt_tokens]), first.sampling_params)
        adapter = None if first.lora is None else self.lora_adapter(first.lora)
        if group_id in self.outputs.groups:
            raise InvalidRequestError("request_id", f"{group_id!r} is already running")
        caches = self._local_kv_caches(connector)
        now = self.clock.now()
        requests = [handoff.restore(self._eos_token_id(), now, self.device) for handoff in handoffs]
        if adapter is not None:
            for request in requests:
                request.lora, request.cache_salt = adapter, adapter.salted(request.cache_salt)
        running = [request for request in requests if not request.is_finished]
        for allocated, request in enumerate(running):
            if self.cache.allocate(request, 0) is None:
                for taken in running[:allocated]:
                    self.cache.free(taken)
                return None
        try:
            for ticket, request in zip(tickets, requests):
                connector.receive(ticket, caches, [] if request.is_finished else self.cache.block_table(request))
        except BaseException:
            for ticket in tickets:
                connector.abort(ticket)
            for request in running:
                self.cache.free(request)
            raise
        requests.sort(key=lambda request: request.index)
        self._track(group_id, requests, output_kind)
        if output_kind == "delta":  # continue after what the sender's delta stream sent
            tracker, sent = self.outputs.groups[group_id], {h.index: h for h in handoffs}
            tracker.sent_tokens = [sent[r.index].sent_tokens for r in requests]
            tracker.sent_chars = [sent[r.index].sent_chars for r in requests]
            tracker.sent_prompt_logprobs = first.sent_prompt_logprobs
        for request in running:
            self.scheduler.add_request(request)
        return group_id

    def _executor_name(self) -> str:
        """The registered name of the engine's executor, for error messages."""
        return self.registry.spec_for_config("executor", self.cfg.executor).name

    def _local_kv_caches(self, connector: KVTransfer) -> list:
        """The executor's KV tensors, or ``ConfigError`` naming why a hand-off through
        ``connector`` cannot run here: the cache is split over processes, or it is only a
        shape (meta tensors: ``executor=simulated``) and the connector moves bytes (only a
        connector with ``handles_meta_caches``, ``kv_transfer=simulated``, takes shapes)."""
        caches = self.executor.local_kv_caches()
        if caches is None:
            raise ConfigError([f"executor={self._executor_name()} does not hold the whole KV cache in this process (tensor or "
                               f"pipeline parallel): a KV hand-off needs one device"])
        if caches and caches[0].is_meta and not connector.handles_meta_caches:
            raise ConfigError([f"executor={self._executor_name()} does not hold the whole KV cache in this process, only its "
                               f"shape (no bytes to move): hand it off with kv_transfer=simulated, which prices the "
                               f"transfer instead of moving it"])
        return caches

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, render: one step; returns the outputs it produced.

        Steps go to the executor until it holds ``max_steps_in_flight`` (more than one
        with a pipeline) or the scheduler has nothing more; then the oldest comes back
        and its result is applied."""
        self._ensure_running("step")
        started = self.clock.now()
        executor, scheduler = self.executor, self.scheduler
        output = None
        while executor.num_in_flight < executor.max_steps_in_flight:
            output = self._with_tier_moves(scheduler.schedule())
            if output.is_empty:
                break
            executor.submit(output)
        if not executor.num_in_flight:
            if scheduler.has_unfinished():
                self._idle_until(scheduler.next_wakeup(), started)
            return self._finish_step(started, ExecutedStep(output, None), SchedulerUpdate())
        executed = executor.collect()
        for computed in executed.prompt_logprobs:
            computed.request.add_prompt_logprobs(computed.first, computed.entries)
        update = scheduler.update_from_output(executed.output, executed.result)
        return self._finish_step(started, executed, update)

    def _with_tier_moves(self, output: SchedulerOutput) -> SchedulerOutput:
        """The step with the cache's tier moves of its scheduling added (``TierMoves``)."""
        moves = self.cache.take_tier_moves()
        if moves is NO_TIER_MOVES:
            return output
        return replace(output, blocks_to_offload=output.blocks_to_offload + moves.offloads,
                       blocks_to_swap_in=output.blocks_to_swap_in + moves.loads,
                       blocks_to_spill=moves.spills, blocks_to_fill=moves.fills)

    def _finish_step(self, started: float, executed: ExecutedStep, update: SchedulerUpdate) -> list[RequestOutput]:
        """Render the step's outputs and tell observers what it did."""
        refused = self.scheduler.take_refused()
        outputs = self.outputs.process((*update.changed, *refused) if refused else update.changed)
        self.num_steps += 1
        self.num_generated_tokens += update.num_generated_tokens
        if not self.hooks.servelab_step_end.get_hookimpls():  # nobody observes: skip the stats
            return outputs
        output, result = executed.output, executed.result
        drafts, accepted = (result.num_draft_tokens, result.num_accepted_drafts) if result else (None, None)
        now = self.clock.now()
        self.hooks.servelab_step_end(engine=self, stats=StepStats(
            step_index=output.step_index, num_prefill_tokens=output.num_prefill_tokens,
            num_decode_tokens=output.num_decode_tokens, num_scheduled=len(output.scheduled),
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_preempted=len(output.preempted), num_finished=update.num_finished,
            num_generated_tokens=update.num_generated_tokens, kv=self.cache.usage, step_time_s=now - started,
            prefix_hit_tokens=output.num_prefix_hit_tokens, spec_proposed=sum(drafts or ()),
            spec_accepted=sum(accepted or ()), stage_busy_s=executed.stage_busy_s, clock_s=now,
            spec_verified=sum(1 for d in drafts or () if d),
            spec_ranks=tuple(result.accepted_ranks or ()) if result else ()))
        return outputs

    def _idle_until(self, wakeup: float | None, now: float) -> None:
        """Nothing can run yet (a batching timer): wait for it briefly instead of spinning
        (a virtual clock jumps to it)."""
        if self.clock.is_virtual and wakeup is not None:
            self.clock.advance_to(wakeup)
        else:
            self.clock.sleep(min(max(wakeup - now, 0.0), 0.01) if wakeup is not None else 0.001)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step holds: the scheduler's budget, else ``max_model_len``."""
        return self.scheduler.max_step_tokens() or self.max_model_len

    def warm_up(self, max_tokens: int | None = None) -> int:
        """Compile the model's kernels for steps of up to ``max_tokens`` tokens (default:
        ``max_step_tokens``, which covers every step) now rather than on each new step
        size's first use (milliseconds per layer each on the CPU); returns the number of
        kernels prepared."""
        self._ensure_running("warm_up")
        if max_tokens is None:
            max_tokens = self.max_step_tokens
        if max_tokens < 0:
            raise ValueError(f"warm_up: max_tokens must be 0 or more, got {max_tokens}")
        return self.executor.warm_up(max_tokens)

    def shutdown(self) -> None:
        """Abort every request, release the executor (workers, process group, model, KV
        tensors, LoRA slots), the decoding strategy, the cache and the LoRA adapters, and
        tell observers the engine stopped. Calling it again does nothing."""
        if self.is_shut_down:
            return
        self.abort_request(list(self.outputs.groups))
        self.is_shut_down = True
        if self.adapter_admission is not None and self.adapter_admission.pool is not None:
            self.adapter_admission.pool.close()
        for component in (self.executor, self.strategy, self.cache):
            component.shutdown()
        self.lora = None
        self.hooks.servelab_engine_stopped(engine=self)
