"""Report a checkpoint's loss on the tiny pair's evaluation sets, per token and per byte.

The sets are those of ``train_tiny_model.py`` (training probe, validation files, held-out
torch sources), encoded with the checkpoint's own tokenizer, so checkpoints with different
tokenizers compare per byte. Weights load as saved (bfloat16) and compute in float32.

    python examples/evaluate_tiny_model.py --venv /tmp/corpus-venv checkpoints/tiny
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch  # noqa: E402

import transformers  # noqa: E402

from tiny_model.corpus import build_corpus  # noqa: E402
from tiny_model.evaluation import evaluate_checkpoint, load_eval_sets  # noqa: E402
from tiny_model.tokenizer import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Print the losses of each checkpoint folder given on the command line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--venv", type=Path, required=True,
                        help="the virtual environment the corpus was built from")
    parser.add_argument("--scratch", type=Path,
                        default=Path.home() / ".cache/servelab-tiny-model",
                        help="cache of token streams (shared with train_tiny_model.py)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    corpus = build_corpus(args.venv)
    for folder in args.folders:
        sets = load_eval_sets(load_tokenizer(folder), corpus, args.scratch, args.seq_len)
        result = {"checkpoint": str(folder), "seq_len": args.seq_len, **sets.summary(),
                  "losses": evaluate_checkpoint(folder, sets)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
