"""Can the Triton kernels run in this process?  (No triton/torch import at module load.)"""

from __future__ import annotations

import importlib.util
import os

_NO_GPU_MESSAGE = (
    "attention=flash needs a CUDA GPU for its Triton kernels; on CPU set "
    "TRITON_INTERPRET=1 to run them in Triton's interpreter (slow) or choose "
    "attention=sdpa or attention=naive"
)


def triton_interpret_enabled() -> bool:
    """True when TRITON_INTERPRET=1 is set (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_unavailable_reason() -> str | None:
    """Return None if the Triton kernels can run here, else a human-readable reason.

    They can run when triton is importable and either a CUDA GPU is visible or
    ``TRITON_INTERPRET=1`` is set (Triton's CPU interpreter).
    """
    if importlib.util.find_spec("triton") is None:
        return (
            "attention=flash needs the 'triton' package, which is not installed; "
            "install it or choose attention=sdpa or attention=naive"
        )
    if triton_interpret_enabled():
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return _NO_GPU_MESSAGE
