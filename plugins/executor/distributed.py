"""The transport of ``executor=model`` over several processes with ``torch.distributed``
(gloo on CPU, NCCL on CUDA): tensor parallelism within a pipeline stage, pipeline stages
in sequence. Each rank computes with a ``DeviceWorker`` (``device_worker.py``); this file
only joins the ranks and moves messages between them.

Global rank ``pp_rank * tp + tp_rank``; rank 0 is the driver (the engine's process: the
scheduler, the cache manager and the decoding strategy run there alone). Every step the
driver sends each worker one int64 header and one int64 payload (the flat batch: token
ids, positions, query starts, context lengths, block table, slots, logits rows, block
moves), not Python objects. A stage sends its carried state (the (output, residual) pair, or
the model's ``CARRIED_TENSORS``) to the same
tensor rank of the next stage, with the stages' busy seconds; the last stage's rank 0
sends the gathered logits back to the driver. On one node the driver starts the workers
(``worker_group.py``); across nodes ``torchrun`` starts every rank
(``parallel.init_method=env``) and ranks above 0 run ``serve_as_worker``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from servelab.core.attention import BatchLayout
from servelab.core.lora_registry import lora_enabled
from servelab.core.model import ModelParallel
from servelab.plugins.executor.device_worker import DeviceWorker

log = logging.getLogger(__name__)

STEP, MOVES, ATTACH, WARM_UP, STOP = 1, 2, 3, 4, 5
LORA_LOAD, LORA_FORGET, LORA_PASS = 6, 7, 8
"""LoRA adapter slot messages (``lora_peers.py``)."""
HEADER_SIZE = 12
GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the others: joining, and any one message."""


@dataclass(frozen=True, slots=True)
class Topology:
    """``tp`` tensor ranks per stage, ``pp`` stages; ranks numbered ``stage * tp + tp_rank``;
    ``ep``: expert-parallel ranks (1, or ``tp``: the tensor ranks hold whole experts), which
    ``expert_dispatch`` (``parallel.expert_dispatch``) brings the tokens to."""

    tp: int
    pp: int
    ep: int = 1
    expert_dispatch: str = "all_reduce"

    @property
    def world_size(self) -> int:
        """Processes in all."""
        return self.tp * self.pp

    def parallel(self, rank: int, groups: list[Any]) -> ModelParallel:
        """The ``ModelParallel`` of ``rank`` (``groups``: each stage's tensor group)."""
        stage, tp_rank = divmod(rank, self.tp)
        return ModelParallel(tp_rank, self.tp, stage, self.pp, groups[stage] if self.tp > 1 else None, self.ep > 1,
                             self.expert_dispatch)

    def next_rank(self, rank: int) -> int:
        """The same tensor rank of the next stage."""
        return rank + self.tp

    @property
    def last_stage_root(self) -> int:
        """Tensor rank 0 of the last stage, which sends the logits to the driver."""
        return (self.pp - 1) * self.tp


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a spawned worker needs: the resolved engine config, its rank, the topology and
    how to join the group."""

    cfg: Any
    rank: int
    topology: Topology
    init_method: str
    backend: str
    threads: int


def backend_for(device: torch.device, requested: str) -> str:
    """``parallel.backend``: auto is NCCL on CUDA, gloo on the CPU."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return requested


def join_group(topology: Topology, rank: int, init_method: str, backend: str) -> list[Any]:
    """Join the world (a spawned worker or its driver) and create the stage groups."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=topology.world_size,
                            timeout=GROUP_TIMEOUT)
    return stage_groups(topology)


def stage_groups(topology: Topology) -> list[Any]:
    """Every stage's tensor group, by stage (all ranks create all groups, in the same order)."""
    return [dist.new_group(list(range(stage * topology.tp, (stage + 1) * topology.tp)))
            for stage in range(topology.pp)] if topology.tp > 1 else [None] * topology.pp


def torchrun_problems(topology: Topology) -> list[str]:
    """Why this process cannot drive a ``torchrun`` world of ``topology`` (empty if it can):
    it must be rank 0 of exactly ``tp x pp`` processes."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return ["parallel.init_method=env needs the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR): "
                "start every rank with torchrun -m servelab.launch (docs/parallel.md)"]
    problems = []
    if int(os.environ["WORLD_SIZE"]) != topology.world_size:
        problems.append(f"torchrun started {os.environ['WORLD_SIZE']} processes but parallel.tensor_parallel_size "
                        f"x pipeline_parallel_size = {topology.tp} x {topology.pp} = {topology.world_size}")
    if int(os.environ["RANK"]) != 0:
        problems.append(f"the engine runs on rank 0 only, this process is rank {os.environ['RANK']}")
    return problems


def drive_torchrun(topology: Topology, backend: str, cfg: Any) -> list[Any]:
    """Rank 0 of a ``torchrun`` world: join it, hand every worker the resolved engine
    config (pickled, as a spawned worker gets it), then create the stage groups."""
    dist.init_process_group(backend, init_method="env://", timeout=GROUP_TIMEOUT)
    dist.broadcast_object_list([cfg], src=0)
    return stage_groups(topology)


def local_world_size(world_size: int) -> int:
    """Ranks on this node: ``torchrun``'s ``LOCAL_WORLD_SIZE``, else the whole world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


# -- the step message ---------------------------------------------------------------------------
def pack_step(inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload of a step's ``StepInputs`` (every KV cache group's block
    table and slots; the groups' tables are equally wide)."""
    layout = inputs.layout
    table = layout.block_table
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[:9] = torch.tensor([STEP, inputs.input_ids.numel(), layout.num_requests, table.shape[1],
                               inputs.logits_indices.numel(), layout.max_query_len, layout.max_seq_len,
                               layout.block_size, len(inputs.layouts)])
    parts = [inputs.input_ids, inputs.positions, layout.query_start_loc, layout.seq_lens, inputs.logits_indices]
    for group in inputs.layouts:
        parts += [group.block_table.reshape(-1), group.slot_mapping]
    return header, torch.cat([p.to("cpu", torch.int64) for p in parts])


def step_payload_size(header: torch.Tensor) -> int:
    """Elements of the payload that follows a step header."""
    tokens, requests, max_blocks, logits = header[1:5].tolist()
    return 2 * tokens + 2 * requests + 1 + logits + int(header[8]) * (requests * max_blocks + tokens)


def unpack_step(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> tuple:
    """The worker's side of ``pack_step``: (input_ids, positions, layouts, logits rows)."""
    tokens, requests, max_blocks, logits, max_query, max_seq, block_size, groups = header[1:9].tolist()
    ids, positions, starts, seq_lens, rows, *tables = payload.split(
        [tokens, tokens, requests + 1, requests, logits] + [requests * max_blocks, tokens] * groups)
    first = BatchLayout(starts.to(device, torch.int32), seq_lens.to(device, torch.int32),
                        tables[0].reshape(requests, max_blocks).to(device, torch.int32), tables[1].to(device),
                        block_size, max_query, max_seq, tuple(starts.diff().tolist()), tuple(seq_lens.tolist()))
    layouts = (first, *(replace(first, block_table=table.reshape(requests, max_blocks).to(device, torch.int32),
                                slot_mapping=slots.to(device)) for table, slots in zip(tables[2::2], tables[3::2])))
    return ids.to(device), positions.to(device), layouts, rows.to(device)


def pack_moves(moves: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload of a step's block moves (offload, swap in, swap out, copy pairs)."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[:1 + len(moves)] = torch.tensor([MOVES, *(len(p) for p in moves)])
    return header, torch.tensor([x for pairs in moves for pair in pairs for x in pair], dtype=torch.int64)


def unpack_moves(header: torch.Tensor, payload: torch.Tensor) -> tuple:
    """The worker's side of ``pack_moves``."""
    counts = header[1:5].tolist()
    return tuple(tuple(map(tuple, part.reshape(-1, 2).tolist())) for part in payload.split([2 * c for c in counts]))


def send_header(kind: int, ranks: range, values: tuple[int, ...] = ()) -> None:
    """A control message (attach, warm-up, stop) to every worker."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = kind
    header[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    for rank in ranks:
        dist.send(header, rank)


# -- the worker -----------------------------------------------------------------------------------
def serve_as_worker(spec: WorkerSpec) -> None:
    """A spawned worker's life: join the group, then ``run_worker``."""
    from servelab.platform import die_with_parent

    die_with_parent()
    torch.set_num_threads(spec.threads)
    groups = join_group(spec.topology, spec.rank, spec.init_method, spec.backend)
    run_worker(spec.cfg, spec.topology, spec.rank, groups)


def serve_torchrun_worker(backend: str) -> None:
    """A ``torchrun`` rank above 0: join the world, receive the engine config from rank 0,
    then ``run_worker``."""
    dist.init_process_group(backend, init_method="env://", timeout=GROUP_TIMEOUT)
    received: list[Any] = [None]
    dist.broadcast_object_list(received, src=0)
    cfg = received[0]
    topology = Topology(cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size,
                        cfg.parallel.expert_parallel_size, cfg.parallel.expert_dispatch)
    torch.set_num_threads(cfg.parallel.threads or default_threads(local_world_size(topology.world_size)))
    run_worker(cfg, topology, dist.get_rank(), stage_groups(topology))


def run_worker(cfg: Any, topology: Topology, rank: int, groups: list[Any]) -> None:
    """Load this rank's share of the model, then run whatever the driver sends until it
    says stop; leave the group."""
    worker = DeviceWorker.for_rank(cfg, topology.parallel(rank, groups), rank)
    lora = None
    if lora_enabled(cfg.get("lora")):
        from servelab.core.engine.registry import get_registry
        from servelab.core.lora_store import open_lora_store
        from servelab.plugins.executor.lora_peers import WorkerLoRA

        store = open_lora_store(cfg.lora, get_registry())
        lora = WorkerLoRA(worker.model, cfg.lora, worker.dtype, worker.device, store)
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    try:
        while True:
            dist.recv(header, 0)
            kind = int(header[0])
            if kind == STOP:
                break
            if kind == ATTACH:
                num_blocks, block_size, host_blocks, num_groups = header[1:5].tolist()
                groups = worker.kv_spec.groups if num_groups > 1 else None
                worker.allocate(num_blocks, block_size, host_blocks, groups)
            elif kind == WARM_UP:
                worker.model.warm_up(int(header[1]))
            elif kind == MOVES:
                payload = torch.empty(2 * int(header[1:4].sum()), dtype=torch.int64)
                dist.recv(payload, 0)
                worker.move_blocks(unpack_moves(header, payload))
            elif kind in (LORA_LOAD, LORA_FORGET, LORA_PASS):
                lora.receive(header)
            elif kind == STEP:
                payload = torch.empty(step_payload_size(header), dtype=torch.int64)
                dist.recv(payload, 0)
                step = unpack_step(header, payload, worker.device)
                if lora is not None:
                    lora.before_step(step[2][0].query_lens)
                run_stage(worker, topology, rank, *step)
    finally:
        dist.destroy_process_group()


def run_stage(worker: DeviceWorker, topology: Topology, rank: int, input_ids: torch.Tensor,
              positions: torch.Tensor, layouts: tuple[BatchLayout, ...], rows: torch.Tensor) -> None:
    """A worker rank's part of one step: receive what the stage before carries on (the
    model's ``CARRIED_TENSORS`` [T, hidden] tensors), run ``worker``'s layers, send on to
    the next stage, or, on the last stage's tensor rank 0, send the logits of ``rows`` to
    the driver, with the stages' busy seconds either way."""
    stage_times = torch.zeros(topology.pp, dtype=torch.float64)
    carried = None
    parallel = worker.parallel
    if not parallel.is_first_stage:
        hidden = worker.model.hf_config.hidden_size
        carried = tuple(torch.empty(input_ids.numel(), hidden, dtype=worker.dtype, device=worker.device)
                        for _ in range(worker.model.CARRIED_TENSORS))
        for tensor in (*carried, stage_times):
            dist.recv(tensor, rank - topology.tp)
    started = time.perf_counter()
    with torch.inference_mode():
        out = worker.forward(input_ids, positions, layouts, carried)
        if parallel.is_last_stage:
            logits = worker.model.compute_logits(out[rows]) if rows.numel() else None
    stage_times[parallel.pp_rank] = time.perf_counter() - started
    if not parallel.is_last_stage:
        for tensor in (*out, stage_times):
            dist.send(tensor.contiguous(), topology.next_rank(rank))
    elif parallel.tp_rank == 0 and rank != 0:
        if logits is not None:
            dist.send(logits.contiguous(), 0)
        dist.send(stage_times, 0)


def default_threads(world_size: int) -> int:
    """Compute threads per rank: the cores this process may use, shared out."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)
