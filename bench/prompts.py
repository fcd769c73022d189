"""Where prompt tokens come from: random token ids, windows of a text corpus, or the
openings of held-out standard-library files (``benchmarks/bench_speculative.py``)."""

from __future__ import annotations

import os
import random
import sysconfig
from typing import Any

from servelab.core.errors import ConfigError

SOURCES = ("random", "corpus")


class PromptSource:
    """Draws prompts of an exact token length.

    ``random``: ids uniform over the vocabulary without special tokens (and without ids
    of a padded embedding that the tokenizer does not know). ``corpus``: the
    corpus file is tokenized once and a prompt is a window of it at a random offset
    (wrapping around), so prompts read like the corpus and have exact lengths.
    """

    def __init__(self, kind: str, vocab_size: int, tokenizer: Any, corpus_file: str | None, rng: random.Random):
        if kind not in SOURCES:
            raise ConfigError([f"workload.prompts must be one of {', '.join(SOURCES)}, got {kind!r}"])
        self.rng = rng
        self.corpus: list[int] | None = None
        if kind == "corpus":
            self.corpus = self._read_corpus(corpus_file, tokenizer)
        else:
            special = set(getattr(tokenizer, "all_special_ids", None) or [])
            size = min(vocab_size, len(tokenizer)) if tokenizer is not None else vocab_size  # padded embeddings
            self.vocabulary = [t for t in range(size) if t not in special]

    @staticmethod
    def _read_corpus(corpus_file: str | None, tokenizer: Any) -> list[int]:
        if not corpus_file:
            raise ConfigError(["workload.corpus_file must name a text file when workload.prompts=corpus"])
        if tokenizer is None:
            raise ConfigError(["workload.prompts=corpus needs a model with a tokenizer"])
        try:
            with open(corpus_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError([f"workload.corpus_file={corpus_file!r} cannot be read: {exc}"]) from exc
        tokens = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # no "longer than the model" warning
        if not tokens:
            raise ConfigError([f"workload.corpus_file={corpus_file!r} holds no tokens"])
        return tokens

    def draw(self, length: int) -> list[int]:
        """A prompt of ``length`` token ids."""
        if self.corpus is None:
            return self.rng.choices(self.vocabulary, k=length)
        start = self.rng.randrange(len(self.corpus))
        repeats = -(-(start + length) // len(self.corpus))
        return (self.corpus * repeats)[start:start + length]


def stdlib_file_openings(count: int, tokenizer: Any, prompt_tokens: int, every: int = 20) -> list[list[int]]:
    """Up to ``count`` prompts: the first ``prompt_tokens`` token ids of every ``every``-th
    Python file of the standard library (sorted paths, without site-packages, tests and
    idlelib), skipping shorter files. With ``every=20`` these are files of the validation
    split the tiny checkpoints were trained without (``docs/results/speculative.md``), so
    a draft model sees text like its training data but not its training data."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                   if f.endswith(".py") and "site-packages" not in d and "/test" not in d and "idlelib" not in d)
    prompts = []
    for path in files[::every]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            ids = tokenizer.encode(f.read(), add_special_tokens=False, verbose=False)  # no "too long" warning
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            break
    return prompts
