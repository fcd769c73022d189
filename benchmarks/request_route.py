"""The route one request takes through servelab's source, file by file.

Traces the Python calls of one request after a warm-up (``sys.setprofile`` in every
thread) and lists the servelab source files it enters, in the order first entered, with
how many times the route entered each from another file. Resuming a suspended coroutine
is not a call (so the server's main loop, which wakes on its own timer, does not count):

    python benchmarks/request_route.py offline      # LLM("toy").generate(...)
    python benchmarks/request_route.py http         # a streamed /v1/completions, both processes

``http`` starts ``servelab-serve model=toy`` with a ``sitecustomize`` that installs the
recorder in the server process and in the engine process; SIGUSR1 starts a recording,
SIGUSR2 writes it out. docs/architecture.md lists both routes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 8

RECORDER = textwrap.dedent('''
    """Records which files of ``ROUTE_ROOT`` Python calls enter (see request_route.py)."""
    import json, os, signal, sys, threading

    ROOT = os.environ["ROUTE_ROOT"]
    OUT = os.environ.get("ROUTE_OUT")
    SUSPENDABLE = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine, iterable coroutine, async generator
    entries = {}
    recording = False

    def first_offset():
        """Where a generator's frame stands on its first call (later calls resume it)."""
        offsets = []

        def probe(frame, event, arg):
            if event == "call" and frame.f_code is started.__code__:
                offsets.append(frame.f_lasti)

        def started():
            yield

        sys.setprofile(probe)
        next(started())
        sys.setprofile(None)
        return offsets[0]

    FIRST = first_offset()

    def profile(frame, event, arg):
        if not recording or event != "call":
            return
        code = frame.f_code
        if code.co_flags & SUSPENDABLE and frame.f_lasti > FIRST:
            return  # a suspended coroutine resumed: no call enters a file here
        path = code.co_filename
        if not path.startswith(ROOT) or "/.venv" in path or "/site-packages/" in path:
            return
        caller = frame.f_back
        if caller is None or caller.f_code.co_filename != path:
            entries[path] = entries.get(path, 0) + 1

    def start(*_):
        global recording
        entries.clear()
        recording = True

    def stop(*_):
        global recording
        recording = False
        if OUT:
            with open(f"{OUT}.{os.getpid()}", "w") as f:
                json.dump(entries, f)

    sys.setprofile(profile)
    threading.setprofile(profile)
    if OUT:
        signal.signal(signal.SIGUSR1, start)
        signal.signal(signal.SIGUSR2, stop)
''')


def relative(path: str) -> str:
    """``path`` relative to the repository."""
    return os.path.relpath(path, ROOT)


def print_route(title: str, entries: dict[str, int]) -> None:
    """The files of one route in first-entry order (dicts keep insertion order)."""
    print(f"{title}: {len(entries)} files")
    for number, (path, times) in enumerate(entries.items(), 1):
        print(f"  {number:2d}. {relative(path)}" + (f"  (entered {times}x)" if times > 1 else ""))


def load_recorder(folder: str) -> None:
    """Write the recorder as ``sitecustomize`` into ``folder``."""
    Path(folder, "sitecustomize.py").write_text(RECORDER)


def offline() -> dict[str, int]:
    """The files ``LLM("toy").generate`` enters for one prompt, after one warm-up call."""
    from servelab import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with LLM("toy") as llm:
        llm.generate([PROMPT], params, use_tqdm=False)
        sys.path.insert(0, tempfile.mkdtemp())
        load_recorder(sys.path[0])
        os.environ["ROUTE_ROOT"] = str(ROOT)
        import sitecustomize as recorder  # noqa: the recorder, not the environment's

        recorder.start()
        llm.generate([PROMPT], params, use_tqdm=False)
        recorder.recording = False
        return dict(recorder.entries)


def http() -> dict[str, dict[str, int]]:
    """The files a streamed ``/v1/completions`` enters in the server and the engine
    process, after one warm-up request."""
    import httpx

    from servelab.testing.server_process import ServerProcess

    folder = tempfile.mkdtemp()
    load_recorder(folder)
    out = os.path.join(folder, "route")
    env = {"ROUTE_ROOT": str(ROOT), "ROUTE_OUT": out,
           "PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))}
    server = ServerProcess.servelab(os.path.join(folder, "server.log"), "model=toy", env=env)
    try:
        body = {"model": "toy", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        stream(httpx, server.url, body)
        processes = [server.pid, *child_pids(server.pid)]
        signal_all(processes, signal.SIGUSR1)
        stream(httpx, server.url, body)
        signal_all(processes, signal.SIGUSR2)
        time.sleep(1.0)
        routes = {process_name(pid): json.loads(Path(f"{out}.{pid}").read_text()) for pid in processes}
        return {name: entries for name, entries in routes.items() if entries}
    finally:
        server.stop()


def stream(httpx, url: str, body: dict) -> None:
    """One streamed completion, read to its end."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def signal_all(pids: list[int], number: int) -> None:
    """Send ``number`` to every process and give their handlers a moment to run."""
    for pid in pids:
        os.kill(pid, number)
    time.sleep(0.5)


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (the engine process)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def process_name(pid: int) -> str:
    """``server process`` for the server, else the child's role from its command line."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    if "servelab.server" in command:
        return "server process"
    return "engine process" if "spawn_main" in command else f"process {pid}"


def main() -> None:
    """Trace the chosen route and print its files."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("route", choices=["offline", "http"])
    args = parser.parse_args()
    if args.route == "offline":
        print_route("LLM.generate", offline())
        return
    routes = http()
    for name, entries in routes.items():
        print_route(name, entries)
    union = {path for entries in routes.values() for path in entries}
    print(f"streamed /v1/completions: {len(union)} distinct files across both processes")


if __name__ == "__main__":
    main()
