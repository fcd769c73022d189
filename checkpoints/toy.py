"""Random weights and a byte-level tokenizer built in memory (``model=toy`` and other
shapes with ``random_weights``)."""

from __future__ import annotations

from typing import Any, Iterator

import torch

EOS_TOKEN = "<|endoftext|>"


def byte_level_tokenizer() -> Any:
    """A 257-token byte-level tokenizer (256 bytes + ``<|endoftext|>``), no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[EOS_TOKEN] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   model_max_length=1 << 20)


def random_weights(hf_config: Any, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random weights, under Hugging Face names, for ``hf_config``."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config)
    yield from model.state_dict().items()
