"""What the pair's evaluation scripts share: the corpus arguments and a quiet torch."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """``--venv``, ``--scratch``, ``--seq-len`` and ``--threads`` of a script that reads the
    evaluation sets of ``train_tiny_model.py``."""
    parser.add_argument("--venv", type=Path, required=True,
                        help="the virtual environment the corpus was built from")
    parser.add_argument("--scratch", type=Path,
                        default=Path.home() / ".cache/servelab-tiny-model",
                        help="cache of token streams (shared with train_tiny_model.py)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)


def configure_torch(threads: int) -> None:
    """``threads`` torch threads, denormals flushed, transformers' logging and progress bars off."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
