"""The pair's shared tokenizer and the token streams it makes of the corpus.

A byte-level BPE (``tokenizers``), vocabulary ``VOCAB_SIZE``, trained on the training
files; ``<|endoftext|>`` is BOS, EOS, padding and document separator. Token streams are
cached as ``uint16`` arrays under the scratch folder, keyed by the files and the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from .corpus import SourceFile, read_text

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 1024


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``; ``<|endoftext|>`` is bos, eos and pad."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return wrap(tokenizer)


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a ``tokenizers`` one, with the special tokens set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT, pad_token=EOT,
        model_max_length=MODEL_MAX_LENGTH, clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by ``save_tokenizer`` (or ``tokenizer.json`` itself)."""
    path = Path(path)
    return wrap(Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path)))


def fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """A short hash of the tokenizer's vocabulary and merges."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    blob = json.dumps([model["vocab"], model["merges"]], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_roundtrip(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> None:
    """Raise if ``decode(encode(text))`` does not reproduce any of ``texts`` exactly."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if tokenizer.decode(ids) != text:
            raise RuntimeError("tokenizer does not round-trip Python source exactly")


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """Save the tokenizer files so that ``AutoTokenizer.from_pretrained(folder)`` loads them.

    ``tokenizer_class`` is pinned to ``PreTrainedTokenizerFast`` and a
    ``special_tokens_map.json`` is written so that older transformers releases load it too.
    """
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_files(tokenizer: PreTrainedTokenizerFast, files: tuple[SourceFile, ...],
                 cache_dir: Path | None = None, chunk: int = 256) -> np.ndarray:
    """One ``uint16`` stream of ``files``, each preceded by ``<|endoftext|>``, one at the end.

    With ``cache_dir`` the stream is stored there as ``tokens-<hash>.npy`` (hash of the
    file keys, sizes and the tokenizer) and read back on the next call.
    """
    key = hashlib.sha256(json.dumps(
        [fingerprint(tokenizer), [(f.key, f.size) for f in files]]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"tokens-{key}.npy" if cache_dir else None
    if path is not None and path.exists():
        return np.load(path)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    parts: list[np.ndarray] = []
    for start in range(0, len(files), chunk):
        texts = [read_text(f) for f in files[start: start + chunk]]
        for ids in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
            parts.append(np.array([eot, *ids.ids], dtype=np.uint16))
    parts.append(np.array([eot], dtype=np.uint16))
    stream = np.concatenate(parts)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path.with_suffix(".tmp.npy"), stream)
        path.with_suffix(".tmp.npy").rename(path)
    return stream
