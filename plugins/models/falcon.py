"""Falcon (``FalconForCausalLM``) on flat token batches.

Rotary attention through one fused ``query_key_value`` projection, a GELU MLP
(``dense_h_to_4h`` / ``dense_4h_to_h``), LayerNorms with biases, the LM head tied to
the embedding. The config picks the layout:

- 7B (``multi_query``, ``parallel_attn``): one ``input_layernorm`` feeds attention and
  the MLP side by side, whose outputs add to the residual; the projection holds every
  query head, then one key and one value head.
- ``new_decoder_architecture`` (40B/180B): ``ln_attn`` and ``ln_mlp`` (one
  ``input_layernorm`` with ``num_ln_in_parallel_attn=1``), ``num_kv_heads`` KV heads;
  the projection is grouped per KV head: its query heads, then its key, then its value.
- neither: as many KV heads as heads, the projection interleaved per head (q, k, v);
  ``parallel_attn=false`` runs attention, then ``post_attention_layernorm`` and the MLP.

Refused with a ``ConfigError``: ``alibi=true`` (position biases in the attention scores,
which no attention backend takes) and ``new_decoder_architecture`` with
``parallel_attn=false`` (transformers cannot run it either).

Tensor parallelism takes each rank's query heads and KV heads (replicated when fewer
than the ranks) out of the fused projection in the order above, ``dense`` and
``dense_4h_to_h`` columns, ``dense_h_to_4h`` rows; a parallel layer sums attention and
MLP with one all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.model import ModelParallel, ModelShape
from servelab.plugins.models.decoder import (DecoderForCausalLM, HeadSplit, RotaryEmbedding, VocabEmbedding,
                                             WeightPiece, tied_embeddings)
from servelab.plugins.models.linear import Linear

ARCHITECTURES = ("FalconForCausalLM",)


def kv_heads_of(hf_config: Any) -> int:
    """KV heads of the layout (see the module docstring)."""
    if hf_config.new_decoder_architecture:
        return hf_config.num_kv_heads
    return 1 if hf_config.multi_query else hf_config.num_attention_heads


def config_problems(hf_config: Any) -> list[str]:
    """Why servelab cannot run this Falcon config (empty when it can)."""
    problems = []
    if hf_config.alibi:
        problems.append("Falcon with alibi=true is not supported: ALiBi adds position biases to the attention "
                        "scores, which no attention backend takes; rotary checkpoints (alibi=false) run")
    if hf_config.new_decoder_architecture and not hf_config.parallel_attn:
        problems.append("Falcon with new_decoder_architecture=true and parallel_attn=false is not supported "
                        "(transformers has no such layer either)")
    return problems


class FalconAttention(nn.Module):
    """The fused projection (this rank's rows, reordered as [q | k | v]), rotary
    embedding, backend attention and ``dense``; the output is this rank's partial sum."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.split = HeadSplit.of(heads, kv_heads_of(hf_config), hidden // heads, parallel)
        self.query_key_value = Linear(hidden, self.split.q_size + 2 * self.split.kv_size, bias=bool(hf_config.bias))
        self.dense = Linear(self.split.q_size, hidden, bias=bool(hf_config.bias))
        self.checkpoint_rows = self._checkpoint_rows(hf_config)
        self.layer_index = layer_index
        self.attention = attention
        self.rotary = rotary

    def _checkpoint_rows(self, hf_config: Any) -> torch.Tensor:
        """The checkpoint's ``query_key_value`` rows this rank holds, in [q | k | v] order."""
        split = self.split
        heads, kv = split.total_heads, split.total_kv_heads
        if hf_config.new_decoder_architecture:
            group = heads // kv
            q = [(h // group) * (group + 2) + h % group for h in split.heads]
            k = [g * (group + 2) + group for g in split.kv_heads]
        elif hf_config.multi_query:
            q, k = list(split.heads), [heads]
        else:
            q, k = [3 * h for h in split.heads], [3 * h + 1 for h in split.kv_heads]
        blocks = torch.tensor(q + k + [row + 1 for row in k])
        return (blocks[:, None] * split.head_dim + torch.arange(split.head_dim)).flatten()

    def pieces(self, leaf: str, tensor: torch.Tensor) -> list[WeightPiece] | None:
        """This rank's rows of ``query_key_value`` (weight and bias), reordered."""
        if not leaf.startswith("query_key_value."):
            return None
        return [WeightPiece(leaf, 0, tensor[self.checkpoint_rows])]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """x: [T, hidden] -> this rank's share of the output [T, hidden]."""
        tokens, split = x.shape[0], self.split
        qkv = self.query_key_value(x).view(tokens, -1, split.head_dim)
        q, k, v = qkv.split((len(split.heads), len(split.kv_heads), len(split.kv_heads)), dim=1)
        q, k = self.rotary(positions, q, k)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.layer_index)
        return self.dense(out.reshape(tokens, split.q_size))


class FalconMLP(nn.Module):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))`` over this rank's columns (partial sum)."""

    def __init__(self, hf_config: Any, parallel: ModelParallel):
        super().__init__()
        columns = len(parallel.split(hf_config.ffn_hidden_size))
        self.dense_h_to_4h = Linear(hf_config.hidden_size, columns, bias=bool(hf_config.bias))
        self.dense_4h_to_h = Linear(columns, hf_config.hidden_size, bias=bool(hf_config.bias))
        from transformers.activations import get_activation

        self.act = get_activation(hf_config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> this rank's share of the output [T, hidden]."""
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    """One layer in the config's layout (see the module docstring)."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        self.parallel_attn = bool(hf_config.parallel_attn)
        self.two_norms = bool(hf_config.new_decoder_architecture) and (hf_config.num_ln_in_parallel_attn or 2) == 2
        self.self_attention = FalconAttention(hf_config, layer_index, attention, rotary, parallel)
        self.mlp = FalconMLP(hf_config, parallel)
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        if not self.parallel_attn:
            self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.parallel = parallel

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> tuple:
        """h: [T, hidden] -> (the next layer's input,)."""
        reduce = self.parallel.all_reduce
        if not self.parallel_attn:
            h = h + reduce(self.self_attention(self.input_layernorm(h), positions, kv_cache, meta))
            return (h + reduce(self.mlp(self.post_attention_layernorm(h))),)
        if self.two_norms:
            attention_in, mlp_in = self.ln_attn(h), self.ln_mlp(h)
        else:
            attention_in = mlp_in = self.input_layernorm(h)
        attention_out = self.self_attention(attention_in, positions, kv_cache, meta)
        return (h + reduce(self.mlp(mlp_in) + attention_out),)


class FalconModel(nn.Module):
    """Hugging Face's ``transformer``: ``word_embeddings`` (first stage, and the last when
    tied), this stage's layers ``h``, ``ln_f`` (last stage)."""

    def __init__(self, hf_config: Any, attention: Any, rotary: RotaryEmbedding, parallel: ModelParallel,
                 embedding: bool):
        super().__init__()
        if embedding:
            self.word_embeddings = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, parallel)
        self.h = nn.ModuleList(FalconDecoderLayer(hf_config, local, attention, rotary, parallel)
                               for local, _ in enumerate(parallel.layer_range(hf_config.num_hidden_layers)))
        if parallel.is_last_stage:
            self.ln_f = nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon)


class FalconForCausalLM(DecoderForCausalLM):
    """Falcon causal LMs (see the module docstring)."""

    LAYER_PREFIX = "transformer.h."
    STAGE_WEIGHTS = ("transformer.word_embeddings.", "transformer.ln_f.", "lm_head.")
    ROW_PARALLEL = ("dense", "dense_4h_to_h")
    CARRIED_TENSORS = 1
    COLUMN_PARALLEL = ("dense_h_to_4h",)

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """The layout's KV heads, a plain MLP of ``ffn_hidden_size``; refuses what
        ``config_problems`` names."""
        problems = config_problems(hf_config)
        if problems:
            raise ConfigError(problems)
        heads = hf_config.num_attention_heads
        return ModelShape(hf_config.num_hidden_layers, heads, kv_heads_of(hf_config), hf_config.hidden_size // heads,
                          None, hf_config.max_position_embeddings, hf_config.vocab_size, hf_config.hidden_size,
                          hf_config.ffn_hidden_size, tied_embeddings(hf_config), mlp_kind="plain")

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__(hf_config, attention, dtype, max_positions, parallel)
        problems = config_problems(hf_config)
        if problems:
            raise ConfigError(problems)
        head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        self.rotary = RotaryEmbedding(hf_config, head_dim, max_positions, dtype)
        self.transformer = FalconModel(hf_config, attention, self.rotary, parallel, self.needs_embedding())
        self.finish_init(hf_config.hidden_size, getattr(self.transformer, "word_embeddings", None), dtype)
        self.rotary.to(dtype)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """This stage's decoder layers."""
        return self.transformer.h

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The embedded tokens."""
        return (self.transformer.word_embeddings(input_ids),)

    def final_hidden(self, state: tuple) -> torch.Tensor:
        """``ln_f`` of the last layer's output."""
        return self.transformer.ln_f(state[0])


def model_specs() -> list[ComponentSpec]:
    """Registry entries for Falcon."""
    return [ComponentSpec("model", name, FalconForCausalLM, None, "Falcon decoder (fused query_key_value, rotary)")
            for name in ARCHITECTURES]
