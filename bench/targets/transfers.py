"""The KV transfers of a simulated disaggregated run: each request's way from its prefill
instance to its decode instance, and their statistics for ``metrics.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from servelab.bench.metrics import RequestRecord, distribution_ms
from servelab.core.kv_transfer import TransferTicket


@dataclass(slots=True)
class Transfer:
    """One request's move from prefill instance ``source`` to decode instance ``target``:
    its ``tickets``, the decode blocks it needs and the bytes it moves, and when it was
    handed off (``ready``), found room (``room``), went on the link (``start``), arrived
    and was admitted (virtual seconds)."""

    tickets: tuple[TransferTicket, ...]
    source: int
    target: int
    ready: float
    num_blocks: int
    num_bytes: int
    room: float = math.nan
    start: float = math.nan
    arrived: float = math.nan
    admitted: float = math.nan


def transfer_summary(done: Sequence[Transfer], records: Sequence[RequestRecord], link: Any) -> dict[str, Any]:
    """The ``link``; the transfers' time on it (``transfer_ms``), waiting for it
    (``link_wait_ms``) and their bytes; the queueing before them: for a prefill slot
    (``prefill_queue_ms``, arrival to first scheduled) and for a decode instance with
    room (``decode_queue_ms``: hand-off to room, plus arrival to admission, the decode
    instance's next step boundary or room when its cache filled meanwhile)."""
    prefill_wait = [r.scheduling_delay for r in records if r.ok and r.scheduling_delay is not None]
    return {
        "link": {"name": link.name, "bandwidth": link.bandwidth, "latency_s": link.latency_s, "streams": link.streams},
        "num_transfers": len(done),
        "transfer_ms": distribution_ms([t.arrived - t.start for t in done]),
        "transfer_bytes_mean": sum(t.num_bytes for t in done) / len(done) if done else None,
        "link_wait_ms": distribution_ms([t.start - t.room for t in done]),
        "prefill_queue_ms": distribution_ms(prefill_wait),
        "decode_queue_ms": distribution_ms([(t.room - t.ready) + (t.admitted - t.arrived) for t in done]),
    }
