"""Communication on the roofline: ring all-reduce and all-gather among tensor-parallel ranks,
point-to-point sends between pipeline stages, and which layers each stage holds.

A collective among ``devices`` ranks costs ``hardware.interconnect_latency_s`` plus its
bytes over the bus bandwidth of the slowest link of the ring: NVLink-class
``interconnect_bandwidth`` inside a node; beyond ``devices_per_node`` the ring crosses
nodes, where the node's ``devices_per_node`` network links (``network_bandwidth`` each)
carry it in parallel rings (NCCL's). Both bandwidths are scaled by
``hardware.interconnect_efficiency``, the fraction of the link a collective reaches.
"""

from __future__ import annotations

from servelab.core.config import HardwareConfig


def ring_bandwidth(devices: int, hardware: HardwareConfig) -> float:
    """Bytes/s one rank of a ``devices``-rank ring moves: the interconnect inside a node;
    across nodes the smaller of it and the node's network links together."""
    bandwidth = hardware.interconnect_bandwidth
    if devices > hardware.devices_per_node:
        bandwidth = min(bandwidth, hardware.network_bandwidth * hardware.devices_per_node)
    return bandwidth * hardware.interconnect_efficiency


def all_reduce_time(num_bytes: float, devices: int, hardware: HardwareConfig) -> float:
    """Seconds of a ring all-reduce of ``num_bytes`` on each of ``devices`` ranks: each rank
    sends and receives 2 (n - 1) / n of the buffer (reduce-scatter, then all-gather)."""
    if devices <= 1 or num_bytes <= 0:
        return 0.0
    moved = 2.0 * (devices - 1) / devices * num_bytes
    return hardware.interconnect_latency_s + moved / ring_bandwidth(devices, hardware)


def all_gather_time(num_bytes: float, devices: int, hardware: HardwareConfig) -> float:
    """Seconds to gather ``num_bytes`` (the whole result, each rank holding 1/n of it) on
    every rank of a ring: (n - 1) / n of it through each link. An all-to-all in which each
    rank sends ``num_bytes`` spread evenly over the ranks (expert parallelism's dispatch
    and combine) moves as much through each link."""
    if devices <= 1 or num_bytes <= 0:
        return 0.0
    return hardware.interconnect_latency_s + (devices - 1) / devices * num_bytes / ring_bandwidth(devices, hardware)


def send_time(num_bytes: float, crosses_nodes: bool, hardware: HardwareConfig) -> float:
    """Seconds to send ``num_bytes`` from one device to another: over the interconnect, or
    over one network link when the two are on different nodes."""
    if num_bytes <= 0:
        return 0.0
    bandwidth = hardware.network_bandwidth if crosses_nodes else hardware.interconnect_bandwidth
    return hardware.interconnect_latency_s + num_bytes / (bandwidth * hardware.interconnect_efficiency)


def stage_layer_counts(num_layers: int, stages: int) -> list[int]:
    """Layers of each pipeline stage: contiguous ranges as even as possible, the first
    stages taking one more when they do not divide (the last stage also runs the LM head)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if stage < extra else 0) for stage in range(stages)]


def pipeline_crosses_nodes(tensor_parallel_size: int, pipeline_parallel_size: int, hardware: HardwareConfig) -> bool:
    """True when some stage boundary is between nodes (stages are placed in order, each
    on ``tensor_parallel_size`` consecutive devices): the slowest hop prices every send."""
    return pipeline_parallel_size > 1 and tensor_parallel_size * pipeline_parallel_size > hardware.devices_per_node
