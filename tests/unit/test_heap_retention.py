"""Freed heap memory stays in the process: steps that allocate and free tensors of a few
MiB reuse warm pages instead of faulting fresh ones in."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")

STEPS = textwrap.dedent("""
    import ctypes, resource, sys, torch
    from servelab.platform import retain_freed_heap_memory
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: faults count 4 KiB pages on every host
    if sys.argv[1] == "retain":
        assert retain_freed_heap_memory()
    def step(i):  # a cycle of five steps' activations of a few MiB each, freed out of order
        sizes = [(1 + ((i % 5) * 7 + k * 3) % 11) << 20 for k in range(6)]
        live = [torch.ones(size, dtype=torch.uint8) for size in sizes]
        del live[::2]
        more = [torch.ones(2 * size, dtype=torch.uint8) for size in sizes[:3]]
    for i in range(10):
        step(i)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(10, 40):
        step(i)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def page_faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(result.stdout.strip())


def test_retained_heap_memory_stops_page_faults_between_steps():
    retained, default = page_faults("retain"), page_faults("default")
    assert retained * 4 < default, f"{retained} page faults with retention against {default} without"


def test_cpu_engine_retains_heap_memory(llama):
    from servelab import LLM
    from servelab.platform import retain_freed_heap_memory

    retain_freed_heap_memory.cache_clear()
    LLM(llama, overrides=["model.dtype=float32", "device=cpu"])
    assert retain_freed_heap_memory.cache_info().currsize == 1
