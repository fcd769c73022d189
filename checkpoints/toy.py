"""A deterministic random Llama and byte-level tokenizer built in memory (``model=toy``)."""

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


def random_llama_config(spec: Any, vocab_size: int, eos_token_id: int) -> Any:
    """A ``LlamaConfig`` with the sizes of ``spec`` (a ``RandomModelConfig``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def random_llama_weights(hf_config: Any, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random weights, under Hugging Face names, for ``hf_config``."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(hf_config)
    yield from model.state_dict().items()
