"""``torchrun ... -m servelab.launch <console script> [overrides...]``: one command for every
rank of a multi-node tensor/pipeline-parallel engine.

Rank 0 runs the console script (``servelab``, ``servelab-serve`` or ``servelab-bench``) with
``parallel.init_method=env`` added, so its engine joins the ``torchrun`` world as the
driver; every other rank becomes a worker that receives the engine config from rank 0.
Run the same command on every node (docs/parallel.md)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=<0 or 1> --master-addr=<node 0> \\
        --master-port=29500 -m servelab.launch servelab-serve model=local \\
        model.path=/models/x parallel.tensor_parallel_size=2
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

SCRIPTS = ("servelab", "servelab-serve", "servelab-bench")


def worker_backend(overrides: list[str]) -> str:
    """The ``torch.distributed`` backend a worker joins with: ``parallel.backend=`` when
    the command sets it (not auto), else gloo for ``device=cpu`` or without CUDA, NCCL
    otherwise (what the driver's ``parallel.backend=auto`` picks)."""
    import torch

    settings = dict(o.split("=", 1) for o in overrides if "=" in o)
    backend = settings.get("parallel.backend", "auto")
    if backend != "auto":
        return backend
    return "nccl" if settings.get("device", "auto") != "cpu" and torch.cuda.is_available() else "gloo"


def main() -> None:
    """Dispatch by ``RANK``: the console script on rank 0, a worker elsewhere."""
    if len(sys.argv) < 2 or sys.argv[1] not in SCRIPTS:
        sys.exit(f"usage: torchrun ... -m servelab.launch {{{' | '.join(SCRIPTS)}}} [overrides...]")
    if "RANK" not in os.environ:
        sys.exit("servelab.launch runs under torchrun (RANK is not set); without it, run the command itself")
    script, overrides = sys.argv[1], sys.argv[2:]
    if int(os.environ["RANK"]) == 0:
        (entry,) = entry_points(group="console_scripts", name=script)
        sys.argv = [script, *overrides, "parallel.init_method=env"]
        entry.load()()
        return
    from servelab.plugins.executor.distributed import serve_torchrun_worker

    serve_torchrun_worker(worker_backend(overrides))


if __name__ == "__main__":
    main()
