"""Starting and stopping an OpenAI-compatible server for a benchmark script."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request


def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    """Poll ``GET /v1/models`` until it answers (or the server process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"no answer from {url} within {timeout_s} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the server does not exit within 30 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
