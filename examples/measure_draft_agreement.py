"""Measure how often the tiny draft model's greedy choice matches the tiny target's.

Both models read the held-out validation files of the corpus used by
``train_tiny_model.py`` (packed rows of 512 tokens), teacher-forced, in float32. The
agreement rate is the fraction of positions where ``argmax`` of the draft's logits equals
``argmax`` of the target's: the per-token acceptance rate of greedy speculative decoding
on text like the validation files. The torch held-out rows are measured too.

    python examples/measure_draft_agreement.py --venv /tmp/corpus-venv
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch  # noqa: E402

from tiny_model.corpus import build_corpus  # noqa: E402
from tiny_model.evaluation import load_eval_sets  # noqa: E402
from tiny_model.export import load_float32  # noqa: E402
from tiny_model.runtime import add_corpus_arguments, configure_torch  # noqa: E402
from tiny_model.tokenizer import fingerprint, load_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def greedy_agreement(target: torch.nn.Module, draft: torch.nn.Module, sequences: torch.Tensor,
                     batch_size: int = 8) -> tuple[float, int]:
    """Return (agreement rate, positions compared) of the two models' argmax over ``sequences``."""
    agree = total = 0
    for batch in sequences.split(batch_size):
        target_next = target(input_ids=batch).logits.argmax(dim=-1)
        draft_next = draft(input_ids=batch).logits.argmax(dim=-1)
        agree += (target_next == draft_next).sum().item()
        total += target_next.numel()
    return agree / total, total


def main(argv: list[str] | None = None) -> None:
    """Load both checkpoints and print their greedy agreement on the held-out sets."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_arguments(parser)
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "checkpoints/tiny")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "checkpoints/tiny-draft")
    args = parser.parse_args(argv)
    configure_torch(args.threads)

    tokenizer = load_tokenizer(args.target)
    if fingerprint(load_tokenizer(args.draft)) != fingerprint(tokenizer):
        raise SystemExit("target and draft checkpoints use different tokenizers")
    target, draft = load_float32(args.target), load_float32(args.draft)
    corpus = build_corpus(args.venv)
    sets = load_eval_sets(tokenizer, corpus, args.scratch, args.seq_len)
    for name, rows, files in (("validation", sets.val, len(corpus.val)),
                              ("torch (held out)", sets.torch, len(corpus.torch))):
        rate, positions = greedy_agreement(target, draft, rows)
        print(f"{name}: {files} files, {len(rows)} rows x {args.seq_len} tokens, "
              f"{positions:,} positions; greedy agreement (draft argmax == target argmax): "
              f"{rate:.4f}", flush=True)


if __name__ == "__main__":
    main()
