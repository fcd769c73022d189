"""The evaluation sets of the pair and the losses a checkpoint is reported with.

- ``val``: every token of the held-out validation files (packed rows of ``seq_len``).
- ``torch``: the held-out torch sources (never trained on); ``TORCH_ROWS`` rows taken at
  even strides through their token stream.
- ``train``: ``TRAIN_ROWS`` rows at even strides through the training stream, a
  training-loss probe measured like the others.

Losses are nats per predicted token; per byte they are scaled by the set's tokens per
UTF-8 byte (``nats/byte = nats/token * tokens / bytes``; bits = nats / ln 2), so they
compare across tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .corpus import Corpus
from .export import load_float32
from .tokenizer import encode_files
from .trainer import evaluate, pack

TORCH_ROWS = 256
TRAIN_ROWS = 256
PROBE_ROWS = 64


@dataclass(frozen=True)
class EvalSets:
    """Token streams and evaluation rows ``[n, seq_len]``, with tokens per byte of each set."""

    train_stream: np.ndarray
    val: torch.Tensor
    val_probe: torch.Tensor          # a few val rows for the loss printed during training
    torch: torch.Tensor
    train: torch.Tensor
    tokens_per_byte: dict

    def summary(self) -> dict:
        """Token counts and bytes per token, for ``training.json``."""
        return {
            "train_tokens": int(len(self.train_stream)),
            "val_tokens_evaluated": int(self.val.numel()),
            "torch_tokens_evaluated": int(self.torch.numel()),
            "bytes_per_token": {k: round(1 / v, 4) for k, v in self.tokens_per_byte.items()},
        }


def strided_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows of ``rows`` at even strides (all of them when there are fewer)."""
    if len(rows) <= count:
        return rows
    return rows[torch.linspace(0, len(rows) - 1, count).round().long()]


def load_eval_sets(tokenizer, corpus: Corpus, cache_dir: Path, seq_len: int,
                   small: bool = False) -> EvalSets:
    """Encode (or read cached) streams of the three sets and cut the evaluation rows.

    ``small`` keeps 8 rows of each set (for ``--smoke``).
    """
    streams = {name: encode_files(tokenizer, getattr(corpus, name), cache_dir)
               for name in ("train", "val", "torch")}
    sizes = corpus.summary()
    tokens_per_byte = {name: len(s) / sizes[f"{name}_bytes"] for name, s in streams.items()}
    val = pack(streams["val"], seq_len)
    limit = 8 if small else None
    return EvalSets(
        train_stream=streams["train"],
        val=val[:limit] if small else val,
        val_probe=strided_rows(val, 8 if small else PROBE_ROWS),
        torch=strided_rows(pack(streams["torch"], seq_len), limit or TORCH_ROWS),
        train=strided_rows(pack(streams["train"], seq_len), limit or TRAIN_ROWS),
        tokens_per_byte=tokens_per_byte,
    )


def losses(model, sets: EvalSets) -> dict:
    """Loss of ``model`` on each set: nats/token, nats/byte and bits/byte."""
    out = {}
    for name in ("train", "val", "torch"):
        per_token = evaluate(model, getattr(sets, name))
        per_byte = per_token * sets.tokens_per_byte[name]
        out[name] = {"nats_per_token": round(per_token, 4),
                     "nats_per_byte": round(per_byte, 4),
                     "bits_per_byte": round(per_byte / math.log(2), 4)}
    return out


def evaluate_checkpoint(folder: Path, sets: EvalSets) -> dict:
    """``losses`` of the checkpoint saved in ``folder`` (bfloat16 weights, float32 compute)."""
    return losses(load_float32(folder), sets)
