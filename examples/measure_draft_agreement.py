"""Measure how often the tiny draft model's greedy choice matches the tiny target's.

Both models read the same held-out token sequences (the validation files of the corpus
used by ``train_tiny_model.py``), teacher-forced, in float32. The agreement rate is the
fraction of positions where ``argmax`` of the draft's logits equals ``argmax`` of the
target's: the per-token acceptance rate of greedy speculative decoding.

    python examples/measure_draft_agreement.py
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from train_tiny_model import REPO_ROOT, load_corpus, pack, token_stream  # noqa: E402


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
    """Load both checkpoints and print their greedy agreement on the validation files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "checkpoints/tiny")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "checkpoints/tiny-draft")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-sequences", type=int, default=256,
                        help="number of packed validation sequences compared")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if AutoTokenizer.from_pretrained(args.draft).get_vocab() != tokenizer.get_vocab():
        raise SystemExit("target and draft checkpoints use different tokenizers")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    corpus = load_corpus()
    sequences = pack(token_stream(tokenizer, corpus.val_texts), args.seq_len)
    sequences = sequences[: args.max_sequences]
    rate, positions = greedy_agreement(target, draft, sequences)
    print(f"validation files: {len(corpus.val_files)}, sequences: {len(sequences)} x "
          f"{args.seq_len} tokens, positions compared: {positions:,}")
    print(f"greedy agreement (draft argmax == target argmax): {rate:.4f}")


if __name__ == "__main__":
    main()
