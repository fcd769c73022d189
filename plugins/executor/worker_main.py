"""A spawned rank's entry point: ``python -m servelab.plugins.executor.worker_main``.

Reads its ``WorkerSpec`` (pickled) from stdin, then serves as that rank until the driver
says stop (``distributed.serve_as_worker``).
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    """Read the spec and serve."""
    from servelab.plugins.executor.distributed import serve_as_worker

    serve_as_worker(pickle.load(sys.stdin.buffer))


if __name__ == "__main__":
    main()
