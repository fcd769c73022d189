"""The KV transfer conformance kit: what every ``KVTransfer`` connector must do.

Blocks arrive bit-identical for every cache element type (quantized rows and their
scales included), within one process and from a sender in another process; a ticket stays
valid until the receiver has room; an abort from either side frees the transfer and makes
``receive`` fail clearly; a receiving cache that does not match is refused with nothing
written; a killed sender never hangs the receiver; shutdown drops what was not handed over.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from typing import Any, ClassVar

import pytest
import torch

from servelab.core.kv_transfer import HandOff, KVTransferContext, KVTransferError
from servelab.core.sampling_params import SamplingParams
from servelab.testing.kit import ConformanceKit

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 8, 4, 2, 8
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
"""Element types a cache may hold (one-byte types carry 4 scale bytes per row)."""


def cache_layers(dtype: torch.dtype, seed: int | None = None) -> list[torch.Tensor]:
    """One instance's per-layer caches, random bytes for ``seed`` (zeros for None): tensors
    ``[2, num_blocks, ...]`` viewed blocks first, as ``Executor.local_kv_caches`` hands
    them over (not contiguous, so writes must go through the view)."""
    row = HEAD_DIM + (4 if torch.empty((), dtype=dtype).element_size() == 1 else 0)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, row)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype).movedim(1, 0) for _ in range(NUM_LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).view(dtype).view(shape)
            .movedim(1, 0) for _ in range(NUM_LAYERS)]


def block_bytes(layers: list[torch.Tensor], block_ids: list[int]) -> list[bytes]:
    """The raw bytes of ``block_ids`` of every layer, keys and values."""
    return [layer[block_ids].contiguous().view(torch.uint8).numpy().tobytes() for layer in layers]


def handoff(request_id: str = "req-0") -> HandOff:
    """A request's state after its prefill: 9 prompt tokens and a first token."""
    return HandOff(request_id, tuple(range(10)), 9, 9, SamplingParams(max_tokens=5, seed=3),
                   torch.Generator().manual_seed(3).get_state())


SENDER = textwrap.dedent('''
    import json, pickle, sys
    from servelab.core.engine.registry import get_registry
    from servelab.core.kv_transfer import KVTransferContext
    from servelab.testing.kv_transfer_kit import cache_layers, handoff
    import torch

    name, dtype_name, seed, config = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    registry = get_registry()
    connector = registry.build("kv_transfer", registry.get("kv_transfer", name).config_cls(**config),
                               KVTransferContext("prefill-remote", registry))
    ticket = connector.send(cache_layers(getattr(torch, dtype_name), seed), [6, 1, 3], handoff("remote"))
    sys.stdout.write(pickle.dumps(ticket).hex() + "\\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the receiver says when it is done
''')


def start_remote_sender(name: str, dtype_name: str, seed: int,
                        config: dict[str, Any] | None = None) -> tuple[subprocess.Popen, Any]:
    """A process that sends blocks [6, 1, 3] of ``cache_layers(dtype, seed)`` with connector
    ``name`` (its config dataclass built from ``config``, JSON values) and exits when it
    reads a line; returns it and its ticket."""
    sender = subprocess.Popen([sys.executable, "-c", SENDER, name, dtype_name, str(seed), json.dumps(config or {})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return sender, pickle.loads(bytes.fromhex(sender.stdout.readline().strip()))


class KVTransferConformance(ConformanceKit):
    """Run against every registered KV transfer connector (or the ``names`` listed).
    ``configs`` maps a connector name to keyword arguments of its config dataclass (JSON
    values: the sender in another process is built with them too)."""

    kind = "kv_transfer"
    configs: ClassVar[dict[str, dict[str, Any]]] = {}

    def build(self, name: str, instance_id: str) -> Any:
        """Connector ``name`` for instance ``instance_id``, from the process-wide registry."""
        from servelab.core.engine.registry import get_registry

        registry = get_registry()
        config = registry.get(self.kind, name).config_cls(**self.configs.get(name, {}))
        return registry.build(self.kind, config, KVTransferContext(instance_id, registry))

    def pair(self, name: str) -> tuple[Any, Any]:
        """A prefill-side and a decode-side connector."""
        return self.build(name, "prefill-0"), self.build(name, "decode-0")

    @pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
    def test_blocks_arrive_bit_identical(self, component, dtype):
        sender, receiver = self.pair(component)
        source, target = cache_layers(dtype, seed=1), cache_layers(dtype)
        ticket = sender.send(source, [5, 0, 2], handoff())
        assert ticket.num_blocks == 3 and ticket.num_layers == NUM_LAYERS and sender.num_in_flight == 1
        got = receiver.receive(ticket, target, [1, 7, 4])
        sent = handoff()
        assert (got.request_id, got.token_ids, got.num_prompt_tokens, got.num_computed_tokens, got.sampling_params) == (
            sent.request_id, sent.token_ids, sent.num_prompt_tokens, sent.num_computed_tokens, sent.sampling_params)
        assert torch.equal(got.generator_state, sent.generator_state)
        assert block_bytes(target, [1, 7, 4]) == block_bytes(source, [5, 0, 2])
        assert block_bytes(target, [0, 2, 3, 5, 6]) == block_bytes(cache_layers(dtype), [0, 2, 3, 5, 6])
        assert sender.num_in_flight == 0
        sender.shutdown()
        receiver.shutdown()

    def test_a_transfer_of_no_blocks_carries_its_hand_off(self, component):
        """A sequence that stopped at its first token moves with its siblings, without blocks."""
        sender, receiver = self.pair(component)
        stopped = HandOff("req-0#1", tuple(range(10)), 9, 9, SamplingParams(max_tokens=5), group_id="req-0", index=1,
                          num_sequences=2, finish_reason="stop", stop_reason=9, token_times=(1.5,), arrival_time=1.0)
        ticket = sender.send(cache_layers(torch.float32, seed=8), [], stopped)
        assert ticket.num_blocks == 0 and ticket.num_bytes == 0
        target = cache_layers(torch.float32)
        assert receiver.receive(ticket, target, []) == stopped
        assert not any(layer.contiguous().view(torch.uint8).any() for layer in target)
        assert sender.num_in_flight == 0
        sender.shutdown()
        receiver.shutdown()

    def test_blocks_arrive_from_another_process(self, component):
        receiver = self.build(component, "decode-0")
        sender, ticket = start_remote_sender(component, "bfloat16", 7, self.configs.get(component))
        try:
            target = cache_layers(torch.bfloat16)
            assert receiver.receive(ticket, target, [0, 1, 2]).request_id == "remote"
            assert block_bytes(target, [0, 1, 2]) == block_bytes(cache_layers(torch.bfloat16, seed=7), [6, 1, 3])
        finally:
            sender.communicate("done\n", timeout=60)
        assert sender.returncode == 0
        receiver.shutdown()

    def test_ticket_waits_until_the_receiver_has_room(self, component):
        sender, receiver = self.pair(component)
        source = cache_layers(torch.float32, seed=2)
        first = sender.send(source, [0, 1], handoff("a"))
        second = sender.send(source, [2, 3, 4], handoff("b"))
        assert sender.num_in_flight == 2
        target = cache_layers(torch.float32)
        assert receiver.receive(second, target, [5, 6, 7]).request_id == "b"
        assert receiver.receive(first, target, [0, 1]).request_id == "a"
        assert block_bytes(target, [0, 1, 5, 6, 7]) == block_bytes(source, [0, 1, 2, 3, 4])
        assert sender.num_in_flight == 0
        sender.shutdown()
        receiver.shutdown()

    @pytest.mark.parametrize("side", ["sender", "receiver"])
    def test_abort_frees_the_transfer(self, component, side):
        sender, receiver = self.pair(component)
        ticket = sender.send(cache_layers(torch.float16, seed=3), [1, 2], handoff())
        (sender if side == "sender" else receiver).abort(ticket)
        assert sender.num_in_flight == 0
        target = cache_layers(torch.float16)
        with pytest.raises(KVTransferError, match=ticket.transfer_id):
            receiver.receive(ticket, target, [3, 4])
        assert block_bytes(target, list(range(NUM_BLOCKS))) == block_bytes(cache_layers(torch.float16),
                                                                           list(range(NUM_BLOCKS)))
        receiver.abort(ticket)  # harmless once done
        sender.shutdown()
        receiver.shutdown()

    @pytest.mark.parametrize("mismatch", ["layers", "dtype", "block_ids", "out_of_range"])
    def test_mismatched_receiving_cache_is_refused(self, component, mismatch):
        sender, receiver = self.pair(component)
        ticket = sender.send(cache_layers(torch.float32, seed=4), [0, 1], handoff())
        target = {"layers": cache_layers(torch.float32)[:2], "dtype": cache_layers(torch.bfloat16)}.get(
            mismatch, cache_layers(torch.float32))
        block_ids = {"block_ids": [0], "out_of_range": [0, NUM_BLOCKS]}.get(mismatch, [2, 3])
        with pytest.raises(KVTransferError, match=ticket.transfer_id):
            receiver.receive(ticket, target, block_ids)
        assert all(not layer.contiguous().view(torch.uint8).any() for layer in target)
        good = cache_layers(torch.float32)
        receiver.receive(ticket, good, [2, 3])  # the refused transfer is still whole
        assert block_bytes(good, [2, 3]) == block_bytes(cache_layers(torch.float32, seed=4), [0, 1])
        sender.shutdown()
        receiver.shutdown()

    def test_killed_sender_never_hangs_the_receiver(self, component):
        receiver = self.build(component, "decode-0")
        sender, ticket = start_remote_sender(component, "float32", 5, self.configs.get(component))
        sender.kill()
        sender.wait(timeout=60)
        target = cache_layers(torch.float32)
        try:
            receiver.receive(ticket, target, [0, 1, 2])
        except KVTransferError as exc:
            assert ticket.transfer_id in str(exc)
            assert not any(layer.contiguous().view(torch.uint8).any() for layer in target)
        else:
            assert block_bytes(target, [0, 1, 2]) == block_bytes(cache_layers(torch.float32, seed=5), [6, 1, 3])
        receiver.shutdown()

    def test_shutdown_drops_what_was_not_handed_over(self, component):
        sender, receiver = self.pair(component)
        tickets = [sender.send(cache_layers(torch.float32, seed=6), [i], handoff(f"r{i}")) for i in range(3)]
        sender.shutdown()
        assert sender.num_in_flight == 0
        for ticket in tickets:
            with pytest.raises(KVTransferError, match=ticket.transfer_id):
                receiver.receive(ticket, cache_layers(torch.float32), [0])
        receiver.shutdown()
