"""``kv_transfer=simulated``: shape-only hand-offs between simulated engines, each priced
from its bytes over a link; real caches through its data connector (the conformance kit)."""

from __future__ import annotations

import pytest
import torch

from servelab import LLMEngine, SamplingParams
from servelab.core.config import LinkConfig
from servelab.core.engine.registry import get_registry
from servelab.core.entrypoints.compose import compose_config
from servelab.core.errors import ConfigError
from servelab.core.kv_transfer import KVTransferContext, KVTransferError
from servelab.plugins.kv_transfer.simulated import SimulatedTransferConfig
from servelab.testing import KVTransferConformance
from servelab.testing.kv_transfer_kit import handoff

SIMULATED = ["model=llama-2-7b", "hardware=a100-80gb", "executor=simulated", "cache.num_blocks=64",
             "model.max_model_len=1024"]


class TestSimulatedConnectorKeepsTheContract(KVTransferConformance):
    """Real caches move through ``kv_transfer.data`` (shared memory), bit for bit."""

    names = ("simulated",)


def connector(instance_id: str, **config):
    registry = get_registry()
    return registry.build("kv_transfer", SimulatedTransferConfig(**config), KVTransferContext(instance_id, registry))


def meta_caches(num_layers: int = 3, num_blocks: int = 8, dtype: torch.dtype = torch.float16, row: int = 8):
    return [torch.empty((num_blocks, 2, 4, 2, row), dtype=dtype, device="meta") for _ in range(num_layers)]


def test_meta_caches_travel_as_a_ticket_of_their_bytes():
    sender, receiver = connector("prefill-0"), connector("decode-0")
    ticket = sender.send(meta_caches(), [5, 0, 2], handoff())
    assert ticket.num_bytes == 3 * 3 * (2 * 4 * 2 * 8) * 2 and sender.num_in_flight == 1
    with pytest.raises(KVTransferError, match="carries no bytes"):
        receiver.receive(ticket, [torch.zeros(8, 2, 4, 2, 8, dtype=torch.float16)] * 3, [0, 1, 2])
    with pytest.raises(KVTransferError, match="block shape and dtype|the blocks sent"):
        receiver.receive(ticket, meta_caches(dtype=torch.bfloat16), [0, 1, 2])
    assert receiver.receive(ticket, meta_caches(), [1, 7, 4]).request_id == "req-0"
    assert sender.num_in_flight == 0
    with pytest.raises(KVTransferError, match="aborted or already received"):
        receiver.receive(ticket, meta_caches(), [1, 7, 4])


def test_an_aborted_or_dropped_transfer_cannot_be_received():
    sender, receiver = connector("prefill-0"), connector("decode-0")
    aborted = sender.send(meta_caches(), [1], handoff("a"))
    receiver.abort(aborted)
    dropped = sender.send(meta_caches(), [2], handoff("b"))
    sender.shutdown()
    for ticket in (aborted, dropped):
        with pytest.raises(KVTransferError, match=ticket.transfer_id):
            receiver.receive(ticket, meta_caches(), [0])
    assert sender.num_in_flight == 0


def test_price_is_the_fixed_cost_plus_bytes_over_the_bandwidth():
    sender = connector("prefill-0")
    small, large = (sender.send(meta_caches(), list(range(n)), handoff(f"r{n}")) for n in (1, 4))
    link = LinkConfig(bandwidth=1e9, latency_s=1e-5)
    assert sender.price(small, link) == pytest.approx(1e-5 + small.num_bytes / 1e9)
    assert sender.price(large, link) > sender.price(small, link)
    assert sender.price(large, LinkConfig(1e10, 1e-5)) < sender.price(large, link)
    assert sender.price(large, link, streams=2) == pytest.approx(1e-5 + large.num_bytes / 2e9)
    one_byte = sender.send(meta_caches(dtype=torch.int8, row=8 + 4), list(range(4)), handoff("q"))
    assert one_byte.num_bytes == large.num_bytes * 12 // 16       # 8 values + a 4-byte scale per row
    sender.shutdown()


@pytest.mark.parametrize("data, message", [("simulated", "kv_transfer.data='simulated' must name another"),
                                           ("carrier_pigeon", "carrier_pigeon")])
def test_the_data_connector_must_be_another_registered_one(data, message):
    with pytest.raises(ConfigError, match=message):
        connector("prefill-0", data=data)


def test_a_simulated_engine_hands_off_to_another_through_it():
    prefill, decode = LLMEngine(compose_config(SIMULATED)), LLMEngine(compose_config(SIMULATED + ["cache=paged"]))
    sender, receiver = connector("prefill-0"), connector("decode-0")
    prefill.add_request(list(range(1, 41)), SamplingParams(max_tokens=6, ignore_eos=True), request_id="r")
    while not prefill.ready_to_hand_off():
        prefill.step()
    tickets = prefill.hand_off("r", sender)
    assert tickets[0].num_blocks == 3 and tickets[0].num_layers == 32     # 40 tokens of 16-token blocks, 32 layers
    assert tickets[0].num_bytes == 32 * 3 * 16 * 2 * 32 * 128 * 2            # every KV head, float16
    assert prefill.cache.num_free_blocks == 64 and not prefill.has_unfinished_requests()
    assert decode.admit_handed_off(tickets, receiver) == "r"
    outputs = []
    while decode.has_unfinished_requests():
        outputs += decode.step()
    final = [o for o in outputs if o.finished][0]
    assert len(final.outputs[0].token_ids) == 6 and len(final.metrics.token_times) == 6
    assert decode.cache.num_free_blocks == 64 and sender.num_in_flight == 0
    prefill.shutdown()
    decode.shutdown()


def test_a_tensor_parallel_simulated_engine_sends_every_kv_head():
    engine = LLMEngine(compose_config(SIMULATED + ["parallel.tensor_parallel_size=2"]))
    caches = engine.executor.local_kv_caches()
    assert len(caches) == 32 and caches[0].is_meta and tuple(caches[0].shape) == (64, 2, 16, 32, 128)
    engine.shutdown()
