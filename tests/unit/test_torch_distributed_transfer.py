"""``kv_transfer=torch_distributed`` through the conformance kit, and beyond it: bad
settings are refused naming them, an unreachable store and a silent sender fail within
``timeout_s``, a receiver in another process pulls blocks and aborts through the store,
and shutdown leaves no thread and frees the store's port."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from servelab.core.engine.registry import get_registry
from servelab.core.errors import ConfigError
from servelab.core.kv_transfer import KVTransferContext, KVTransferError
from servelab.platform import free_port
from servelab.plugins.kv_transfer.torch_distributed import (TorchDistributedTransfer, TorchDistributedTransferConfig,
                                                            host_identity)
from servelab.testing.kv_transfer_kit import KVTransferConformance, block_bytes, cache_layers, handoff

PORT = free_port()


class TestTorchDistributedConformance(KVTransferConformance):
    """The kit over gloo on CPU, on a port of its own."""

    names = ("torch_distributed",)
    configs = {"torch_distributed": {"port": PORT, "timeout_s": 10.0}}


def connector(instance_id: str, **settings) -> TorchDistributedTransfer:
    """A connector on the module's port (``settings`` override the config's fields)."""
    config = TorchDistributedTransferConfig(**{"port": PORT, "timeout_s": 10.0, **settings})
    return TorchDistributedTransfer(config, KVTransferContext(instance_id))


def test_registered_under_its_name():
    assert get_registry().get("kv_transfer", "torch_distributed").cls is TorchDistributedTransfer


def test_bad_settings_are_refused_naming_each_one():
    with pytest.raises(ConfigError) as info:
        connector("decode-0", backend="mpi", port=70000, timeout_s=0.0)
    problems = info.value.problems
    assert any(p.startswith("kv_transfer.backend='mpi' must be one of auto, gloo, nccl") for p in problems)
    assert any(p.startswith("kv_transfer.port=70000 must be in [1, 65535]") for p in problems)
    assert any(p.startswith("kv_transfer.timeout_s=0.0 must be > 0") for p in problems)


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is selectable where CUDA is")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="kv_transfer.backend='nccl' needs a CUDA device"):
        connector("decode-0", backend="nccl")


def test_an_unreachable_store_names_host_and_port():
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"kv_transfer.host='192.0.2.1', kv_transfer.port=\d+: no TCPStore answered "
                                          r"within kv_transfer.timeout_s=0.5"):
        connector("decode-0", host="192.0.2.1", port=free_port(), timeout_s=0.5)
    assert time.monotonic() - started < 10


def test_a_sender_that_never_answers_fails_within_the_timeout():
    receiver = connector("decode-0", timeout_s=0.5)
    sender = connector("prefill-0")
    ticket = sender.send(cache_layers(torch.float32, seed=1), [0], handoff())
    sender.shutdown()
    silent = dataclasses.replace(ticket, address=f"servelab-kv/nobody/0@{host_identity()}", sender=os.getpid())
    started = time.monotonic()
    with pytest.raises(KVTransferError, match="did not answer within kv_transfer.timeout_s=0.5"):
        receiver.receive(silent, cache_layers(torch.float32), [0])
    assert time.monotonic() - started < 5
    receiver.shutdown()


RECEIVER = textwrap.dedent('''
    import json, pickle, sys
    from servelab.core.kv_transfer import KVTransferContext, KVTransferError
    from servelab.plugins.kv_transfer.torch_distributed import TorchDistributedTransfer, TorchDistributedTransferConfig
    from servelab.testing.kv_transfer_kit import block_bytes, cache_layers
    import torch

    receiver = TorchDistributedTransfer(TorchDistributedTransferConfig(**json.loads(sys.argv[1])),
                                        KVTransferContext("decode-remote"))
    for line in sys.stdin:
        command, ticket = line.split()
        ticket = pickle.loads(bytes.fromhex(ticket))
        if command == "abort":
            receiver.abort(ticket)
            answer = "aborted"
        else:
            target = cache_layers(ticket.dtype)
            try:
                receiver.receive(ticket, target, [7, 3, 0][:ticket.num_blocks])
                answer = b"".join(block_bytes(target, [7, 3, 0][:ticket.num_blocks])).hex()
            except KVTransferError as exc:
                answer = "error: " + str(exc)
        sys.stdout.write(answer + "\\n")
        sys.stdout.flush()
    receiver.shutdown()
''')


def test_a_receiver_in_another_process_pulls_and_aborts_through_the_store():
    sender = connector("prefill-0")
    source = cache_layers(torch.bfloat16, seed=9)
    first, second, third = (sender.send(source, ids, handoff(f"r{i}")) for i, ids in
                            enumerate([[5, 0, 2], [1, 4], [6, 7, 3]]))
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, json.dumps({"port": PORT, "timeout_s": 10.0})],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(command, ticket):
        """Have the receiving process ``receive`` or ``abort`` the ticket; its answer line."""
        receiver.stdin.write(f"{command} {pickle.dumps(ticket).hex()}\n")
        receiver.stdin.flush()
        return receiver.stdout.readline().strip()

    try:
        assert ask("receive", first) == b"".join(block_bytes(source, [5, 0, 2])).hex()
        assert ask("receive", third) == b"".join(block_bytes(source, [6, 7, 3])).hex()  # the pair's group again
        assert ask("receive", first) == f"error: KV transfer {first.transfer_id!r}: it was aborted or already received"
        assert ask("abort", second) == "aborted"
        assert ask("receive", second).startswith(f"error: KV transfer {second.transfer_id!r}: it was aborted")
        assert sender.num_in_flight == 0
    finally:
        receiver.stdin.close()
        receiver.wait(timeout=60)
    assert receiver.returncode == 0
    sender.shutdown()


def test_shutdown_stops_the_thread_and_frees_the_port():
    port = free_port()
    sender, receiver = connector("prefill-0", port=port), connector("decode-0", port=port)
    ticket = sender.send(cache_layers(torch.int8, seed=2), [1, 2], handoff())
    target = cache_layers(torch.int8)
    receiver.receive(ticket, target, [3, 4])
    assert block_bytes(target, [3, 4]) == block_bytes(cache_layers(torch.int8, seed=2), [1, 2])
    sender.shutdown()
    receiver.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-transfer-")]
    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # nobody listens there any more
