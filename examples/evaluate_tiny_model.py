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

from tiny_model.corpus import build_corpus  # noqa: E402
from tiny_model.evaluation import evaluate_checkpoint, load_eval_sets  # noqa: E402
from tiny_model.runtime import add_corpus_arguments, configure_torch  # noqa: E402
from tiny_model.tokenizer import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Print the losses of each checkpoint folder given on the command line as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    add_corpus_arguments(parser)
    args = parser.parse_args(argv)
    configure_torch(args.threads)
    corpus = build_corpus(args.venv)
    for folder in args.folders:
        sets = load_eval_sets(load_tokenizer(folder), corpus, args.scratch, args.seq_len)
        result = {"checkpoint": str(folder), "seq_len": args.seq_len, **sets.summary(),
                  "losses": evaluate_checkpoint(folder, sets)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
