"""``target=inproc``: servelab's ``LLMEngine`` in this process, with per-step statistics."""

from __future__ import annotations

import zlib
from typing import Any

from omegaconf import DictConfig

from servelab.bench.metrics import RequestRecord
from servelab.bench.step_observer import StepObserver
from servelab.bench.system import SteppedSystem
from servelab.bench.workload import BenchRequest, TokenSpace


def record_from_output(output: Any) -> RequestRecord:
    """A ``RequestRecord`` from a finished servelab ``RequestOutput`` (one completion)."""
    metrics = output.metrics
    return RequestRecord(
        request_id=output.request_id, arrival_time=metrics.arrival_time, token_times=tuple(metrics.token_times),
        num_prompt_tokens=len(output.prompt_token_ids), num_output_tokens=len(output.outputs[0].token_ids),
        num_cached_prompt_tokens=metrics.num_cached_prompt_tokens, num_preemptions=metrics.num_preemptions,
        spec_proposed=metrics.spec_proposed_tokens, spec_accepted=metrics.spec_accepted_tokens,
        scheduled_time=metrics.first_scheduled_time, finish_reason=output.outputs[0].finish_reason,
        output_token_ids=tuple(output.outputs[0].token_ids))


class ServelabSystem(SteppedSystem):
    """Builds an ``LLMEngine`` from the composed bench config and drives it step by step;
    a ``StepObserver`` is registered for the measured requests only. A simulated engine
    serves the workload's ``num_adapters`` adapters without weights
    (``register_shape_only``)."""

    name = "servelab"

    def __init__(self, cfg: DictConfig):
        from servelab.core.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(cfg)
        self.clock = self.engine.clock
        self.simulated = self.clock.is_virtual
        self.space = TokenSpace(self.engine.vocab_size, self.engine.max_model_len, self.engine.tokenizer)
        self.workload = cfg.workload
        if self.simulated and cfg.workload.get("num_adapters"):
            from servelab.bench.adapter_popularity import adapter_names
            from servelab.plugins.executor.simulated_lora import register_shape_only

            register_shape_only(self.engine, adapter_names(cfg.workload), list(cfg.workload.adapter_ranks),
                                list(cfg.workload.adapter_projections))
        self.observer: StepObserver | None = None
        self.experts_before = None
        self.lora_before = None

    def add(self, request: BenchRequest, arrival_time: float) -> RequestRecord | None:
        """Submit to the engine; a rejected request becomes a failed record."""
        from servelab.core.errors import InvalidRequestError
        from servelab.core.sampling_params import SamplingParams

        seed = zlib.crc32(f"{self.workload.seed}:{request.request_id}".encode())
        params = SamplingParams(temperature=self.workload.temperature, max_tokens=request.max_tokens,
                                ignore_eos=self.workload.ignore_eos, seed=seed)
        try:
            self.engine.add_request(list(request.prompt_token_ids), params, request_id=request.request_id,
                                    arrival_time=arrival_time, metadata=request.metadata, lora=request.lora)
        except InvalidRequestError as exc:
            return RequestRecord(request.request_id, arrival_time, (), len(request.prompt_token_ids), 0, error=str(exc))
        return None

    def step(self) -> list[RequestRecord]:
        """One engine step; records of the finished requests."""
        return [record_from_output(o) for o in self.engine.step() if o.finished]

    def has_work(self) -> bool:
        """True while the engine has unfinished requests."""
        return self.engine.has_unfinished_requests()

    def begin(self) -> None:
        """Register a fresh step observer; note the experts' load and the LoRA slots'
        paging so far (warm-up's)."""
        self.observer = StepObserver(self.engine)
        self.engine.registry.plugin_manager.register(self.observer)
        self.experts_before = self.engine.executor.expert_load()
        self.lora_before = self.engine.executor.lora_stats()

    def end(self) -> dict[str, Any]:
        """Unregister the observer; its summary, with the load of a mixture of experts'
        layers during the measured requests (``experts``: ``ExpertLoad.summary``) and the
        LoRA slots' paging (``lora``: hit rate, adapters paged in, their load time in ms,
        steps split into several passes)."""
        self.engine.registry.plugin_manager.unregister(self.observer)
        summary = self.observer.summary()
        load = self.engine.executor.expert_load()
        if load is not None:
            summary["experts"] = (load - self.experts_before if self.experts_before is not None else load).summary()
        stats, before = self.engine.executor.lora_stats(), self.lora_before
        if stats is not None:
            hits, misses = stats.hits - before.hits, stats.misses - before.misses
            summary["lora"] = {"hit_rate": hits / (hits + misses) if hits + misses else 0.0, "loads": misses,
                               "load_ms": 1000 * (stats.load_seconds - before.load_seconds),
                               "split_steps": stats.split_steps - before.split_steps}
        return summary

    def close(self) -> None:
        """Shut the engine down."""
        self.engine.shutdown()
