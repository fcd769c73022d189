"""What an engine leaves in its process: a snapshot of the resources engines may hold,
and the tensors an object still reaches, for the kits that check ``shutdown``.

``ProcessResources.now()`` records the process's children (Linux ``/proc``), its Python
threads, its operating-system threads, whether it belongs to a ``torch.distributed``
process group, its torch thread count and its resident memory; ``assert_released``
compares a later snapshot with an earlier one. Torch's compute threads and the
tokenizer's thread pool are process-wide and made on first use, once: take the earlier
snapshot after one engine has run in the process (the executor kit's ``warm_process``).
"""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType, MethodType, ModuleType
from typing import Any

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def child_pids(pid: int | None = None) -> frozenset[int]:
    """The live (not zombie) children of process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return frozenset(child for child in found if is_alive(child))


def descendant_pids(pid: int) -> frozenset[int]:
    """Every live process below ``pid``: its children, theirs, and so on."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        children = child_pids(frontier.pop()) - found
        found |= children
        frontier += children
    return frozenset(found)


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@dataclass(frozen=True, slots=True)
class ProcessResources:
    """What this process holds that an engine may add to: ``children`` (pids),
    ``python_threads`` (names), ``os_threads`` (count), ``process_group`` (joined a
    ``torch.distributed`` group), ``torch_threads`` and ``rss_bytes``."""

    children: frozenset[int]
    python_threads: tuple[str, ...]
    os_threads: int
    process_group: bool
    torch_threads: int
    rss_bytes: int

    @classmethod
    def now(cls) -> "ProcessResources":
        """The snapshot of this moment (after a garbage collection)."""
        import torch
        import torch.distributed as dist

        gc.collect()
        pid = os.getpid()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        return cls(child_pids(), tuple(sorted(t.name for t in threading.enumerate())),
                   len(os.listdir(f"/proc/{pid}/task")), dist.is_available() and dist.is_initialized(),
                   torch.get_num_threads(), rss_pages * PAGE_BYTES)


def assert_released(before: ProcessResources, rss_slack_bytes: int | None = None) -> ProcessResources:
    """Assert the process holds no more than at ``before``: no new child process (waiting
    up to 30 s for exiting ones), Python or OS thread, no process group, the same torch
    thread count and, when ``rss_slack_bytes`` is given, at most that much more resident
    memory. Returns the snapshot compared."""
    import time

    deadline = time.monotonic() + 30
    after = ProcessResources.now()
    while after.children - before.children and time.monotonic() < deadline:
        time.sleep(0.1)
        after = ProcessResources.now()
    assert not after.children - before.children, f"child processes left behind: {sorted(after.children - before.children)}"
    assert after.python_threads == before.python_threads, (
        f"threads left behind: {after.python_threads} (before: {before.python_threads})")
    assert after.os_threads <= before.os_threads, f"{after.os_threads} OS threads, {before.os_threads} before"
    assert not after.process_group or before.process_group, "a torch.distributed process group was left behind"
    assert after.torch_threads == before.torch_threads, (
        f"torch.get_num_threads() is {after.torch_threads}, was {before.torch_threads}")
    if rss_slack_bytes is not None:
        grown = after.rss_bytes - before.rss_bytes
        assert grown <= rss_slack_bytes, f"resident memory grew by {grown >> 20} MiB (at most {rss_slack_bytes >> 20})"
    return after


def reachable_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through attributes,
    containers and module parameters (not through modules, classes or functions)."""
    import torch

    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, ModuleType, FunctionType, MethodType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack += obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += obj
        if isinstance(obj, torch.nn.Module):
            stack += [*obj.parameters(), *obj.buffers()]
        stack += getattr(obj, "__dict__", {}).values()
        for cls in type(obj).__mro__:
            slots = getattr(cls, "__slots__", ())
            stack += [getattr(obj, slot) for slot in ((slots,) if isinstance(slots, str) else slots)
                      if hasattr(obj, slot)]
    return sum(storages.values())
