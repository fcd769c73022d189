"""The model's LoRA adapter slots: a fixed memory budget on the device that adapters are
paged into when a step needs them, least recently used out first.

``LoRASlots`` wraps the model's projections (``LoRALinear``), pages adapters into them
as ``LoRASlotTable`` decides (``lora_slot_table.py``, shared with the simulator), and runs
a step: its adapters paged in, each token's slot set, the forward
pass. A step whose requests use more adapters than there are slots runs as several
forward passes, each over the requests of as many adapters as there are slots (every
request's attention reads only its own cache, so the split changes no token), their
logits put back in the step's order. Under tensor parallelism the worker ranks mirror
every slot change (``peers``, ``lora_peers.py``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from servelab.core.batch_builder import PromptSpan, build_step_inputs, prompt_span
from servelab.core.errors import ConfigError
from servelab.core.lora_adapter import LoRAAdapter
from servelab.core.scheduler import ScheduledRequest
from servelab.plugins.executor.lora_slot_table import LoRASlotTable
from servelab.plugins.models.lora_linear import LoRABatch, LoRALinear, projections, wrap_projections
from servelab.plugins.models.lora_targets import LoRAPlacement, lora_placements


def slot_count(lora_cfg: Any, slot_bytes: int) -> int:
    """Slots of ``slot_bytes`` each: ``lora.memory_bytes`` // ``slot_bytes`` when a byte
    budget is set, else ``lora.max_adapters``; ``ConfigError`` when that is none."""
    if lora_cfg.max_rank < 1:
        raise ConfigError([f"lora.max_rank must be 1 or more, got {lora_cfg.max_rank}"])
    if lora_cfg.memory_bytes is not None:
        slots = lora_cfg.memory_bytes // slot_bytes
        if slots < 1:
            raise ConfigError([f"lora.memory_bytes={lora_cfg.memory_bytes} holds no adapter slot: one of "
                               f"lora.max_rank={lora_cfg.max_rank} takes {slot_bytes} bytes on this model"])
        return slots
    if lora_cfg.max_adapters < 1:
        raise ConfigError([f"lora.max_adapters must be 1 or more, got {lora_cfg.max_adapters}"])
    return lora_cfg.max_adapters


class LoRASlots(LoRASlotTable):
    """``model``'s decoder projections wrapped with adapter slots (see the module
    docstring) of ``slot_bytes`` each, paged as ``LoRASlotTable`` pages them; ``layers``:
    the wrapped projections by full name."""

    def __init__(self, model: torch.nn.Module, lora_cfg: Any, dtype: torch.dtype, device: torch.device):
        self.model, self.device = model, device
        layers = getattr(model, "decoder_layers", None)
        if layers is None:
            raise ConfigError([f"lora: {type(model).__name__} does not list its decoder layers (decoder_layers), "
                               f"so servelab cannot find the projections to adapt"])
        prefix = next(name for name, module in model.named_modules() if module is layers) + "."
        element = torch.empty((), dtype=dtype).element_size()
        slot_bytes = sum((module.in_features + module.out_features) * lora_cfg.max_rank * fused * element
                         for _, _, module, fused in projections(layers))
        self.slot_bytes = slot_bytes
        super().__init__(slot_count(lora_cfg, slot_bytes))
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = wrap_projections(layers, self.batch, self.num_slots, lora_cfg.max_rank,
                                                              dtype, device, prefix)
        self.unloaded: set[int] = set()  # load ids of adapters no new request can name
        self.placements: dict[int, list[LoRAPlacement]] = {}  # by load id, worked out once per load
        self.segmented = device.type == "cuda"
        """Apply adapters through the Triton kernel (CUDA; Triton's interpreter elsewhere)."""
        self.peers: Any = None
        """Under tensor parallelism, the worker ranks' mirrors of these slots (``LoRAPeers``)."""
        self._paged: list[tuple[int, int]] = []  # (load id, slot) paged in for the next forward pass

    def check(self, adapter: LoRAAdapter) -> None:
        """``InvalidRequestError`` naming the field unless every module of ``adapter``
        lands on a projection of this model with its shapes; keeps where they land."""
        self.placements[adapter.load_id] = lora_placements(self.model, self.layers, adapter)
        if self.peers is not None:
            self.peers.load(adapter)

    def drop(self, adapter: LoRAAdapter) -> None:
        """``adapter`` was unloaded: free its slot now, and again at the first step without
        it after requests still running with it paged it back in."""
        self.unloaded.add(adapter.load_id)
        self._free(adapter.load_id)

    def _free(self, load_id: int) -> None:
        """Empty an unloaded adapter's slot and forget its placements."""
        if self.placements.pop(load_id, None) is not None and self.peers is not None:
            self.peers.forget(load_id)
        slot = self.resident.pop(load_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear(slot)

    def place(self, load_id: int, slot: int) -> None:
        """Write adapter ``load_id`` (checked already) into ``slot``, over what was there."""
        for layer in self.layers.values():
            layer.clear(slot)
        for placement in self.placements[load_id]:
            layer = self.layers[placement.layer]
            layer.place(slot, placement.first_row, placement.a.to(layer.lora_a.device, layer.lora_a.dtype),
                        placement.b.to(layer.lora_b.device, layer.lora_b.dtype))

    def load(self, load_id: int, adapter: LoRAAdapter, slot: int) -> float:
        """Write ``adapter`` into ``slot`` (checked again if it was unloaded and a running
        request needs it back); the wall seconds it took."""
        started = time.perf_counter()
        if load_id not in self.placements:  # unloaded, then needed again by a request still running
            self.check(adapter)
        self.place(load_id, slot)
        self._paged.append((load_id, slot))
        return time.perf_counter() - started

    def _set_groups(self, adapters: Sequence[LoRAAdapter | None], query_lens: Sequence[int]) -> None:
        """Page in ``adapters`` (one per request, None: the base model) and group the step's
        tokens by slot (``use_slots``), on the worker ranks too."""
        used = {adapter.load_id: adapter for adapter in adapters if adapter is not None}
        slots = self.page_in(used) if used else {}
        request_slots = np.array([-1 if a is None else slots[a.load_id] for a in adapters], dtype=np.int32)
        if self.peers is not None:
            self.peers.run_pass(self._paged, request_slots)
        self._paged = []
        self.use_slots(request_slots, query_lens)

    def use_slots(self, request_slots: np.ndarray, query_lens: Sequence[int]) -> None:
        """Group the next forward pass's tokens by slot: each request's ``query_lens[i]``
        tokens run with slot ``request_slots[i]`` (-1: none); on CUDA one segment per
        request, for the Triton kernel."""
        self.batch.segments = None
        if not (request_slots >= 0).any():
            self.batch.groups = []
            return
        if self.segmented:
            starts = np.zeros(len(request_slots) + 1, dtype=np.int32)
            np.cumsum(query_lens, out=starts[1:])
            self.batch.groups = []
            self.batch.segments = (torch.from_numpy(starts).to(self.device),
                                   torch.from_numpy(request_slots).to(self.device))
            return
        token_slots = np.repeat(request_slots, np.array(query_lens))
        adapted = np.flatnonzero(token_slots >= 0)
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        ordered_slots = token_slots[order]
        bounds = [0, *(np.flatnonzero(np.diff(ordered_slots)) + 1).tolist(), len(order)]
        self.batch.groups = [(int(ordered_slots[start]), start, end) for start, end in zip(bounds, bounds[1:])]
        in_place = len(order) == len(token_slots) and bool((order == np.arange(len(order))).all())
        self.batch.rows = None if in_place else torch.from_numpy(order).to(self.device)

    def _forward(self, worker: Any, grants: Sequence[ScheduledRequest], inputs: Any, send: Any) -> torch.Tensor | None:
        """One forward pass over ``grants``' ``inputs`` with their adapters."""
        self._set_groups([grant.request.lora for grant in grants], inputs.layout.query_lens)
        if send is not None:
            send(inputs)
        return worker.logits(inputs)

    def logits(self, worker: Any, grants: Sequence[ScheduledRequest], drafts: Sequence[list[int]],
               block_size: int, send: Any = None) -> tuple[torch.Tensor | None, tuple[PromptSpan, ...]]:
        """Run the step on ``worker`` with its adapters: its logits as ``DeviceWorker.logits``
        gives them (prompt-logprob rows, then the decoder's, each in grant order) and its
        prompt spans. ``send(inputs)``, under tensor parallelism, hands each forward pass's
        ``StepInputs`` to the worker ranks (after ``peers`` sent its slots)."""
        if self.unloaded:
            used = {grant.request.lora.load_id for grant in grants if grant.request.lora is not None}
            for load_id in self.unloaded.intersection(self.resident).difference(used):
                self._free(load_id)
        chunks = self.chunks(grants)
        if len(chunks) == 1:
            inputs = build_step_inputs(grants, drafts, block_size, self.device, prompt_logprobs=True)
            return self._forward(worker, grants, inputs, send), inputs.prompt_spans
        self.split_steps += 1
        draft_iter = iter(drafts)
        grant_drafts = [next(draft_iter, []) if grant.samples and drafts else [] for grant in grants]
        prompt_rows: dict[int, tuple[torch.Tensor, PromptSpan]] = {}
        sample_rows: dict[int, torch.Tensor] = {}
        for chunk in chunks:
            part = [grants[i] for i in chunk]
            inputs = build_step_inputs(part, [grant_drafts[i] for i in chunk if grants[i].samples], block_size,
                                       self.device, prompt_logprobs=True)
            logits = self._forward(worker, part, inputs, send)
            spans = iter(inputs.prompt_spans)
            row = 0
            for i in chunk:
                span = prompt_span(grants[i])
                if span is not None:
                    prompt_rows[i] = (logits[row:row + span.count], next(spans))
                    row += span.count
            for i in chunk:
                if grants[i].samples:
                    count = 1 + len(grant_drafts[i])
                    sample_rows[i] = logits[row:row + count]
                    row += count
        if not prompt_rows and not sample_rows:
            return None, ()
        parts = [prompt_rows[i][0] for i in sorted(prompt_rows)] + [sample_rows[i] for i in sorted(sample_rows)]
        return torch.cat(parts), tuple(prompt_rows[i][1] for i in sorted(prompt_rows))
