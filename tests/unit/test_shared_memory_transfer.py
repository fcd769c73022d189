"""``kv_transfer=shared_memory`` beyond the kit: a bad folder is refused naming the
setting, and the transfers of a sender that no longer runs are deleted, not leaked."""

from __future__ import annotations

import pathlib

import pytest
import torch

from servelab.core.engine.registry import get_registry
from servelab.core.errors import ConfigError
from servelab.core.kv_transfer import KVTransferContext, KVTransferError
from servelab.plugins.kv_transfer.shared_memory import PREFIX, SharedMemoryTransfer, SharedMemoryTransferConfig
from servelab.testing.kv_transfer_kit import cache_layers, handoff, start_remote_sender


def connector(directory: pathlib.Path, instance_id: str = "decode-0") -> SharedMemoryTransfer:
    return SharedMemoryTransfer(SharedMemoryTransferConfig(str(directory)), KVTransferContext(instance_id))


def test_registered_under_its_name():
    assert get_registry().get("kv_transfer", "shared_memory").cls is SharedMemoryTransfer


def test_a_missing_folder_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="kv_transfer.directory='.*nowhere' must be a writable folder"):
        connector(tmp_path / "nowhere")


def test_a_dead_senders_transfers_are_deleted():
    sender, ticket = start_remote_sender("shared_memory", "float32", 5)
    sender.kill()
    sender.wait(timeout=60)
    assert pathlib.Path(ticket.address).exists()
    receiver = connector(pathlib.Path(ticket.address).parent)  # built after the sender died: it cleans up
    assert not list(pathlib.Path(ticket.address).parent.glob(f"{PREFIX}{ticket.sender}-*"))
    with pytest.raises(KVTransferError, match=f"its sender \\(process {ticket.sender}\\) is gone"):
        receiver.receive(ticket, cache_layers(torch.float32), [0, 1, 2])
    receiver.shutdown()


def test_shutdown_leaves_no_file(tmp_path):
    sender = connector(tmp_path, "prefill-0")
    for i in range(3):
        sender.send(cache_layers(torch.bfloat16, seed=i), [i, i + 1], handoff(f"r{i}"))
    assert len(list(tmp_path.iterdir())) == 3 and sender.num_in_flight == 3
    sender.shutdown()
    assert not list(tmp_path.iterdir())
