"""``baseline=transformers``: Hugging Face ``generate`` over static, left-padded batches."""

from __future__ import annotations

import time
import zlib
from collections import deque
from typing import Any

from omegaconf import DictConfig

from servelab.bench.baselines.hf_model import load_hf_model
from servelab.bench.metrics import RequestRecord
from servelab.bench.system import SteppedSystem
from servelab.bench.workload import BenchRequest, TokenSpace


class StepTimer:
    """A ``generate`` streamer that only records when each decoding step produced its
    tokens (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        """Called by ``generate`` with the prompt, then with every step's new tokens."""
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        """Called once generation stops."""


class TransformersSystem(SteppedSystem):
    """Request-level batching with transformers as the engine: when idle, the arrived
    requests (up to ``baseline.batch_size``) are left-padded into one batch and generated
    to the longest ``max_tokens``; nobody joins a running batch. A request's tokens are
    timed at the step that produced them; outputs stop at its ``max_tokens`` (or EOS
    without ``ignore_eos``)."""

    name = "transformers"

    def __init__(self, cfg: DictConfig):
        self.model, self.tokenizer = load_hf_model(cfg.model, cfg.device)
        hf = self.model.config
        self.space = TokenSpace(hf.vocab_size, cfg.model.max_model_len or hf.max_position_embeddings, self.tokenizer)
        self.batch_size = cfg.baseline.batch_size
        self.workload = cfg.workload
        self.eos = getattr(self.tokenizer, "eos_token_id", None)
        self.pad = self.eos if self.eos is not None else 0
        self.queue: deque[tuple[BenchRequest, float]] = deque()

    def add(self, request: BenchRequest, arrival_time: float) -> RequestRecord | None:
        """Queue the request for the next batch."""
        self.queue.append((request, arrival_time))
        return None

    def has_work(self) -> bool:
        """True while requests are queued."""
        return bool(self.queue)

    def step(self) -> list[RequestRecord]:
        """Generate one whole batch; records of all its requests."""
        import torch

        batch = [self.queue.popleft() for _ in range(min(self.batch_size, len(self.queue)))]
        prompts = [list(r.prompt_token_ids) for r, _ in batch]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        timer = StepTimer()
        sample = self.workload.temperature > 0
        if sample:
            torch.manual_seed(zlib.crc32(f"{self.workload.seed}:{batch[0][0].request_id}".encode()))
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r, _ in batch),
                min_new_tokens=0, do_sample=sample, temperature=self.workload.temperature if sample else None,
                top_p=None, top_k=None, pad_token_id=self.pad,
                eos_token_id=None if self.workload.ignore_eos else self.eos, streamer=timer)
        generated = output[:, width:].tolist()
        return [self._record(request, arrival, tokens, timer.times)
                for (request, arrival), tokens in zip(batch, generated)]

    def _record(self, request: BenchRequest, arrival: float, tokens: list[int], times: list[float]) -> RequestRecord:
        count = min(request.max_tokens, len(tokens), len(times))
        if not self.workload.ignore_eos and self.eos in tokens[:count]:
            count = tokens.index(self.eos) + 1
        return RequestRecord(request.request_id, arrival, tuple(times[:count]), len(request.prompt_token_ids), count,
                             output_token_ids=tuple(tokens[:count]))
