"""The executor contract: the seam between the engine's bookkeeping and the forward pass.

``SchedulerOutput`` in, ``DecodeResult`` (token ids, logprobs, speculative counts) out.
``executor=model`` runs the model; ``executor=simulated`` prices the step with a cost
model and lets the clock advance by that time; a parallel executor runs the step on
several devices. The scheduler, the KV cache manager and the decoding strategy's
accounting are the same whichever executor runs.
"""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection

import torch

from servelab.core.clock import Clock
from servelab.core.decoding import DecodeResult
from servelab.core.expert_load import ExpertLoad
from servelab.core.model import ModelShape
from servelab.core.outputs import Logprob
from servelab.core.request import Request
from servelab.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from servelab.core.checkpoint import Checkpoint
    from servelab.core.decoding import DecodingStrategy
    from servelab.core.kv_cache import KVCacheManager, KVCacheSpec
    from servelab.core.component import ComponentBuilder
    from servelab.core.lora_adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The logprobs of ``request``'s prompt tokens ``first .. first + len(entries) - 1``
    (token id -> ``Logprob``: the prompt token and its top alternatives)."""

    request: Request
    first: int
    entries: list[dict[int, Logprob]]


@dataclass(frozen=True, slots=True)
class ExecutedStep:
    """A step back from the executor: the ``output`` it ran, its ``result`` (None when no
    request sampled), ``stage_busy_s``, the seconds each pipeline stage computed for it
    (empty when the executor does not measure stages), and the ``prompt_logprobs`` it
    computed for requests that asked for them."""

    output: SchedulerOutput
    result: DecodeResult | None
    stage_busy_s: tuple[float, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class ExecutorContext:
    """What the engine hands an executor.

    ``checkpoint``: the model (config, tokenizer, architecture; weights when it has any);
    ``shape``: its sizes; ``model_cls``: the registered ``CausalLM`` class; ``dtype`` and
    ``device``; ``max_model_len``; ``attention_config``: the resolved attention backend's
    config; ``engine_cfg``: the whole composed config (``hardware``, ``cost_model`` and
    ``parallel`` nodes included); ``registry``; ``clock``: the engine's time; ``kv_dtype``:
    the KV cache's element type (``cache.kv_dtype``; None = ``dtype``).
    """

    checkpoint: Checkpoint
    shape: ModelShape
    model_cls: type
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    attention_config: Any
    engine_cfg: Any
    registry: ComponentBuilder
    clock: Clock
    kv_dtype: torch.dtype | None = None


class Executor(abc.ABC):
    """Runs the steps the scheduler forms.

    Built as ``cls(config, ExecutorContext)`` before the cache (``kv_cache_budget_bytes``
    sizes it), then ``attach``-ed to the built cache and decoding strategy. Steps go in
    with ``submit`` and come back, oldest first, from ``collect``; up to
    ``max_steps_in_flight`` may be in flight at once (the stages of a pipeline), and the
    engine's scheduler never grants a request whose previous grant is still in flight.
    Subclasses implement ``execute`` (one step, synchronously) or override
    ``submit``/``collect`` to overlap steps.
    """

    max_steps_in_flight: int = 1
    #: False for executors that run no model (no logits: decoding strategies simulate
    #: their acceptance and load no weights); the engine then keeps virtual time.
    runs_model: bool = True
    #: True for executors that return ``ExecutedStep.prompt_logprobs``; the engine refuses
    #: requests asking for prompt logprobs otherwise.
    computes_prompt_logprobs: bool = False
    #: True for executors that run a decoding strategy's ``decode_steps`` (multi-step
    #: decoding): a decode step may give each request up to that many tokens, fed back one
    #: step at a time within the reserved lookahead slots. The engine refuses
    #: ``decode_steps > 1`` with any other executor.
    runs_decode_steps: bool = False

    def __init__(self, config: Any, context: ExecutorContext):
        self.config = config
        self.context = context
        self._submitted: deque[SchedulerOutput] = deque()

    def kv_cache_budget_bytes(self, spec: KVCacheSpec) -> int | None:
        """Bytes of KV cache each device can hold for ``spec`` (per-device heads and
        layers), used by a cache config that sets no size; None: no budget known."""
        return None

    @abc.abstractmethod
    def attach(self, cache: KVCacheManager, strategy: DecodingStrategy) -> None:
        """Bind the built cache manager and decoding strategy (allocate KV tensors, ...)."""

    def execute(self, output: SchedulerOutput) -> DecodeResult | None:
        """Run one step; the tokens of its sampling requests (None if none sample)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither execute nor submit/collect")

    def submit(self, output: SchedulerOutput) -> None:
        """Start a step (by default it runs when collected)."""
        self._submitted.append(output)

    def collect(self) -> ExecutedStep:
        """Finish the oldest step in flight."""
        output = self._submitted.popleft()
        return ExecutedStep(output, self.execute(output))

    @property
    def num_in_flight(self) -> int:
        """Steps submitted and not collected."""
        return len(self._submitted)

    def warm_up(self, max_tokens: int) -> int:
        """Prepare the kernels of steps up to ``max_tokens`` tokens; how many."""
        return 0

    def local_kv_caches(self) -> list[torch.Tensor] | None:
        """Every layer's whole KV cache tensor, viewed with its blocks on the first axis
        (``view[i]`` is block i, whatever the attention backend's layout), when all of them
        live in this process (one device), for KV transfer connectors; None otherwise (the
        default: sharded across ranks, or no tensors at all)."""
        return None

    def expert_load(self) -> ExpertLoad | None:
        """The (token, expert) pairs routed so far in the mixture-of-experts layers this
        process runs (every sparse layer on one device, the first pipeline stage's under
        pipeline parallelism); None for models without experts or executors that do not
        route tokens (the default)."""
        return None

    def add_lora(self, adapter: "LoRAAdapter") -> None:
        """Check that ``adapter`` applies to the model (``InvalidRequestError`` naming the
        field otherwise) and keep it ready for the requests that name it; executors that
        serve no adapters (the default) raise ``ConfigError``."""
        from servelab.core.errors import ConfigError

        raise ConfigError([f"lora: {type(self).__name__} does not serve LoRA adapters; use executor=model"])

    def remove_lora(self, adapter: "LoRAAdapter") -> None:
        """Release what ``adapter`` holds (requests still running with it may take it back)."""

    def lora_stats(self) -> Any:
        """Adapter paging counters (``LoRAStats``), or None where no adapter is served."""
        return None

    def lora_resident(self) -> Collection[int]:
        """The load ids of the adapters in the slots now (none where no adapter is served)."""
        return ()

    def evict_lora(self, load_id: int) -> None:
        """Adapter ``load_id`` left the device (a unified pool took its pages back): its
        slot is free, and its next use pages it in again."""

    def shutdown(self) -> None:
        """Release what the executor holds (worker processes, process groups, the model,
        KV tensors, threads); calling it again does nothing. An executor that starts
        processes or joins a process group also releases them when it is collected or the
        interpreter exits (a ``weakref.finalize``, never an ``atexit`` reference to
        itself). Nothing by default."""
