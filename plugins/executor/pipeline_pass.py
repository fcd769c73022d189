"""One forward pass through every pipeline stage, waited for: how a step with LoRA adapters
runs under pipeline parallelism. Each pass's adapter slots are set on every stage just
before it, so a step split into passes by adapters runs them one after another, and the
engine keeps one such step in flight (no overlap of consecutive steps across stages)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from servelab.core.batch_builder import StepInputs
from servelab.plugins.executor.device_worker import DeviceWorker


class PipelinePass:
    """Stands in for the driver's ``DeviceWorker`` in ``LoRASlots.logits``: ``logits``
    runs the first stage on ``worker``, hands its output to the next stage (whose ranks
    got the step already, as every worker does) and waits for the last stage's logits.
    ``busy_s`` adds up each stage's seconds over the passes run."""

    def __init__(self, worker: DeviceWorker, topology: Any, vocab_size: int):
        self.worker, self.topology, self.vocab_size = worker, topology, vocab_size
        self.busy_s = torch.zeros(topology.pp, dtype=torch.float64)

    def logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """Float32 logits [N, vocab] at ``inputs.logits_indices`` from the last stage (None
        when no row needs them)."""
        started = time.perf_counter()
        hidden = self.worker.forward(inputs.input_ids, inputs.positions, inputs.layouts)
        stage_times = torch.zeros(self.topology.pp, dtype=torch.float64)
        stage_times[0] = time.perf_counter() - started
        for tensor in (*hidden, stage_times):
            dist.send(tensor.contiguous(), self.topology.next_rank(0))
        root, logits = self.topology.last_stage_root, None
        if inputs.logits_indices.numel():
            logits = torch.empty(inputs.logits_indices.numel(), self.vocab_size, dtype=torch.float32)
            dist.recv(logits, root)
        dist.recv(stage_times, root)
        self.busy_s += stage_times
        return logits
