"""Freed heap memory stays in the process: steps that allocate and free tensors of a few
MiB reuse warm pages instead of faulting fresh ones in."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")

MALLINFO = textwrap.dedent("""
    import ctypes, resource, sys, torch
    from servelab.platform import retain_freed_heap_memory
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: faults count 4 KiB pages on every host
    if sys.argv[1] == "retain":
        assert retain_freed_heap_memory()
""")

BLOCK = textwrap.dedent("""
    before = libc.mallinfo2()
    block = torch.ones(8 << 20, dtype=torch.uint8)
    mapped = libc.mallinfo2().hblkhd - before.hblkhd
    del block
    print(mapped, libc.mallinfo2().arena - before.arena)
""")

STEPS = textwrap.dedent("""
    def step(i):  # a cycle of five steps' activations of a few MiB each, freed out of order
        sizes = [(1 + ((i % 5) * 7 + k * 3) % 11) << 20 for k in range(6)]
        live = [torch.ones(size, dtype=torch.uint8) for size in sizes]
        del live[::2]
        more = [torch.ones(2 * size, dtype=torch.uint8) for size in sizes[:3]]
    def cycle(first):
        for i in range(first, first + 5):
            step(i)
        return libc.mallinfo2().arena
    heap, first = cycle(0), 5
    while (grown := cycle(first)) != heap and first < 200:  # until the heap stops growing
        heap, first = grown, first + 5
    before, heap = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, libc.mallinfo2().arena
    for start in range(first + 5, first + 35, 5):
        cycle(start)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, (libc.mallinfo2().arena - heap) // 4096)
""")


LARGE_BLOCKS = textwrap.dedent("""
    from servelab.platform import DEFAULT_MMAP_MAX, mmap_max_setter
    def mapped(size=96 << 20):  # bytes glibc mapped apart for one block of `size`
        before = libc.mallinfo2().hblkhd
        block = torch.ones(size, dtype=torch.uint8)
        return libc.mallinfo2().hblkhd - before
    set_mmap_max = mmap_max_setter()
    set_mmap_max(0)
    inside = mapped()
    set_mmap_max(DEFAULT_MMAP_MAX)
    print(inside, mapped(160 << 20))  # larger than the heap's free memory: not served from it
""")


def probe(script: str, mode: str) -> list[int]:
    """Run ``script`` in a fresh interpreter with or without retention; the numbers it prints."""
    result = subprocess.run([sys.executable, "-c", MALLINFO + script, mode], capture_output=True, text=True, check=True)
    return [int(word) for word in result.stdout.split()]


def test_retention_serves_step_sized_blocks_from_the_heap_and_keeps_them():
    mapped, kept = probe(BLOCK, "retain")
    assert mapped == 0 and kept >= 8 << 20, f"an 8 MiB block: {mapped} bytes mapped apart, {kept} bytes kept in the heap"
    mapped, kept = probe(BLOCK, "default")
    assert mapped >= 8 << 20 and kept < 1 << 20, f"without retention: {mapped} bytes mapped apart, {kept} kept"


def test_blocks_past_the_mmap_threshold_ceiling_come_from_the_heap_while_mappings_are_off():
    # 96 MiB: a 2048-token step's gate/up output on the 0.5B shape is 80 MiB, past the
    # 32 MiB ceiling of glibc's mmap threshold; with glibc's default such blocks are mapped.
    inside, outside = probe(LARGE_BLOCKS, "retain")
    assert inside == 0, f"{inside} bytes mapped for a 96 MiB block with M_MMAP_MAX 0"
    assert outside >= 160 << 20, f"with glibc's default a 160 MiB block was not mapped ({outside} bytes)"


def test_retained_heap_memory_stops_page_faults_between_steps():
    # 30 steps allocate about 2 GiB, over 500,000 pages. Retained memory serves them from
    # warm pages: the only fresh pages are those the heap grows by (its fragmentation still
    # grows it by a few MiB now and then), plus a little for Python's own objects. Without
    # retention glibc's thresholds move with the sizes it has seen, and a run faults
    # anywhere from none to most of the pages, so the default is no baseline to compare with.
    faults, grown = probe(STEPS, "retain")
    assert faults <= grown + 512, f"{faults} page faults in 30 steps while the heap grew by {grown} pages"


def test_cpu_engine_retains_heap_memory_and_steps_with_mappings_off(llama, monkeypatch):
    from servelab import LLM, SamplingParams
    from servelab.platform import DEFAULT_MMAP_MAX, mmap_max_setter, retain_freed_heap_memory
    from servelab.plugins.executor import model as model_executor

    settings = []

    def recording_setter():
        set_mmap_max = mmap_max_setter()
        return lambda value: (settings.append(value), set_mmap_max(value))[1]

    monkeypatch.setattr(model_executor, "mmap_max_setter", recording_setter)
    retain_freed_heap_memory.cache_clear()
    llm = LLM(llama, overrides=["model.dtype=float32", "device=cpu"])
    assert retain_freed_heap_memory.cache_info().currsize == 1
    settings.clear()  # whatever ran at start-up
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert settings == [0, DEFAULT_MMAP_MAX] * 3  # around one prefill and two decode steps
