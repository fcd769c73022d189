"""The offline API: ``LLM(model, ...).generate(prompts, params)``."""

from __future__ import annotations

import os
from typing import Any, Sequence

from omegaconf import DictConfig
from tqdm.auto import tqdm

from servelab.core.entrypoints.beam_search import BeamSearch
from servelab.core.entrypoints.compose import compose_config
from servelab.core.engine.llm_engine import LLMEngine
from servelab.core.errors import EngineShutdownError, InvalidRequestError
from servelab.core.outputs import RequestOutput
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import SamplingParams


def model_overrides(model: str | None) -> list[str]:
    """Overrides selecting ``model``: a folder becomes ``model=local model.path=...``, any
    other name a preset (``model=tiny``)."""
    if model is None:
        return []
    if os.path.isdir(model):
        return ["model=local", f"model.path='{os.path.abspath(model)}'"]
    return [f"model={model}"]


class ProgressBar(tqdm):
    """tqdm's bar without its monitor thread, which would outlive every engine (the bar
    is updated every step, so nothing needs the monitor's forced refreshes)."""

    monitor_interval = 0


class LLM:
    """Offline generation over one engine.

    ``LLM("/ckpt", scheduler="static", cache="contiguous", overrides=["cache.block_size=32"])``:
    ``model`` is a preset name or a Hugging Face folder, keyword arguments choose an option
    of a config group, ``overrides`` takes any other Hydra override.

    ``shutdown()`` (or leaving ``with LLM(...) as llm:``, or dropping the last reference)
    releases the engine's workers, process group, model and KV cache, so another engine
    of any configuration can start in the same process.
    """

    def __init__(self, model: str | None = None, overrides: Sequence[str] = (), **choices: Any):
        selected = model_overrides(model) + [f"{group}={option}" for group, option in choices.items()]
        self._attach(LLMEngine(compose_config(selected + list(overrides))))

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "LLM":
        """An LLM over an already composed config."""
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(cfg))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.beam_search = BeamSearch(engine)

    def shutdown(self) -> None:
        """Release the engine (``LLMEngine.shutdown``); calling it again does nothing, and
        ``generate`` raises ``EngineShutdownError`` after it."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def warm_up(self, max_tokens: int | None = None) -> int:
        """Compile the model's CPU matmul kernels for steps of up to ``max_tokens`` tokens
        (default: the scheduler's per-step budget, which covers every step), so the first
        ``generate`` does not pay that compilation; returns the number of kernels prepared."""
        return self.engine.warm_up(max_tokens)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 metadata: RequestMetadata | Sequence[RequestMetadata] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one ``RequestOutput`` per prompt, in order.
        ``metadata`` (one for all prompts, or one per prompt) gives each its priority,
        tenant, deadline and SLO class for the engine's ``policy``; ``lora`` (one for all
        prompts, or one per prompt, None for the base model) the name of the loaded LoRA
        adapter it runs with (docs/lora.md).

        Each prompt is tokenized and validated once, as it enters the engine; a bad one
        raises ``InvalidRequestError`` and nothing runs (the prompts added before it are
        withdrawn before any step).
        """
        if self.engine.is_shut_down:
            raise EngineShutdownError("generate")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        metadatas = metadata if isinstance(metadata, (list, tuple)) else [metadata or NO_METADATA] * len(prompts)
        if len(metadatas) != len(prompts):
            raise ValueError(f"metadata: got {len(metadatas)} for {len(prompts)} prompts")
        adapters = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"lora: got {len(adapters)} for {len(prompts)} prompts")
        engine, beams = self.engine, self.beam_search
        ids: list[str] = []
        try:
            for prompt, p, m, adapter in zip(prompts, params, metadatas, adapters):
                if p.use_beam_search and adapter is not None:
                    raise InvalidRequestError("lora", "beam search runs on the base model only")
                ids.append(beams.add(prompt, p, metadata=m) if p.use_beam_search
                           else engine.add_request(prompt, p, metadata=m, lora=adapter))
        except BaseException:
            beams.abort(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        start_tokens = engine.num_generated_tokens
        with ProgressBar(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            try:
                while engine.has_unfinished_requests():
                    outputs = engine.step()
                    for output in self.beam_search.process(outputs) if self.beam_search.groups else outputs:
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"output {(engine.num_generated_tokens - start_tokens) / elapsed:.1f} tok/s",
                                        refresh=False)
            except BaseException:
                self.beam_search.abort([i for i in ids if i not in finished])
                raise
        return [finished[i] for i in ids]
