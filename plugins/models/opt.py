"""OPT (``OPTForCausalLM``) on flat token batches.

Learned absolute positions (Hugging Face's table is offset by 2 rows), LayerNorms with
biases, q/k/v/out projections with biases (q/k/v fused into one matmul here), a ReLU MLP
``fc1`` / ``fc2`` with biases. ``do_layer_norm_before`` picks pre-norm (most sizes) or
post-norm (350m: each block's norm after its residual add, no final norm);
``word_embed_proj_dim`` != ``hidden_size`` adds ``project_in`` after the embedding and
``project_out`` before the LM head, which is tied to the embedding.

Tensor parallelism splits heads (q/k/v rows, ``out_proj`` columns) and ``fc1`` rows /
``fc2`` columns, each block summing its ranks with one all-reduce; positions,
``project_in`` / ``project_out`` and the norms are replicated. Pipeline stages carry the
hidden state alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from servelab.core.component import ComponentSpec
from servelab.core.model import ModelParallel, ModelShape
from servelab.plugins.models.decoder import DecoderForCausalLM, HeadSplit, VocabEmbedding, WeightPiece, tied_embeddings
from servelab.plugins.models.linear import Linear

ARCHITECTURES = ("OPTForCausalLM",)
POSITION_OFFSET = 2
"""OPT's position table starts 2 rows in (a fairseq legacy)."""


class OPTAttention(nn.Module):
    """q/k/v (fused) and out projections with biases around backend attention, no rotary."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, parallel: ModelParallel):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.split = HeadSplit.of(heads, heads, hidden // heads, parallel)
        self.parallel = parallel
        bias = bool(hf_config.enable_bias)
        self.qkv_proj = Linear(hidden, 3 * self.split.q_size, bias=bias)
        self.out_proj = Linear(self.split.q_size, hidden, bias=bias)
        self.layer_index = layer_index
        self.attention = attention

    def fused_counts(self) -> dict[str, int]:
        """``qkv_proj``'s parameters are filled by three pieces (q, k, v)."""
        return {"qkv_proj": 3}

    def pieces(self, leaf: str, tensor: torch.Tensor) -> list[WeightPiece] | None:
        """This rank's rows of q_proj, k_proj and v_proj."""
        return self.split.qkv_pieces(leaf, tensor)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (summed over the tensor-parallel ranks)."""
        tokens, split = x.shape[0], self.split
        q, k, v = self.qkv_proj(x).view(tokens, -1, split.head_dim).split(len(split.heads), dim=1)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.layer_index)
        return self.parallel.all_reduce(self.out_proj(out.reshape(tokens, split.q_size)))


class OPTDecoderLayer(nn.Module):
    """Attention and MLP blocks, each with its residual add and LayerNorm (before the
    block or after the add, ``do_layer_norm_before``)."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, parallel: ModelParallel):
        super().__init__()
        hidden, affine = hf_config.hidden_size, hf_config.layer_norm_elementwise_affine
        self.pre_norm = bool(hf_config.do_layer_norm_before)
        self.self_attn = OPTAttention(hf_config, layer_index, attention, parallel)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        columns = len(parallel.split(hf_config.ffn_dim))
        self.fc1 = Linear(hidden, columns, bias=bool(hf_config.enable_bias))
        self.fc2 = Linear(columns, hidden, bias=bool(hf_config.enable_bias))
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[hf_config.activation_function]
        self.parallel = parallel

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """fc2(act(fc1(x))), summed over the tensor-parallel ranks."""
        return self.parallel.all_reduce(self.fc2(self.act(self.fc1(x))))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> tuple:
        """h: [T, hidden] -> (the next layer's input,)."""
        if self.pre_norm:
            h = h + self.self_attn(self.self_attn_layer_norm(h), kv_cache, meta)
            return (h + self.mlp(self.final_layer_norm(h)),)
        h = self.self_attn_layer_norm(h + self.self_attn(h, kv_cache, meta))
        return (self.final_layer_norm(h + self.mlp(h)),)


class OPTDecoder(nn.Module):
    """Hugging Face's ``model.decoder``: embeddings and ``project_in`` (first stage), this
    stage's layers, final norm and ``project_out`` (last stage)."""

    def __init__(self, hf_config: Any, attention: Any, parallel: ModelParallel, embedding: bool):
        super().__init__()
        hidden, words = hf_config.hidden_size, hf_config.word_embed_proj_dim
        projected = words != hidden
        if embedding:
            self.embed_tokens = VocabEmbedding(hf_config.vocab_size, words, parallel)
        if parallel.is_first_stage:
            self.embed_positions = nn.Embedding(hf_config.max_position_embeddings + POSITION_OFFSET, hidden)
            self.project_in = Linear(words, hidden, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(hf_config, local, attention, parallel)
                                    for local, _ in enumerate(parallel.layer_range(hf_config.num_hidden_layers)))
        if parallel.is_last_stage:
            final_norm = hf_config.do_layer_norm_before and not getattr(hf_config, "_remove_final_layer_norm", False)
            self.final_layer_norm = (nn.LayerNorm(hidden, elementwise_affine=hf_config.layer_norm_elementwise_affine)
                                     if final_norm else None)
            self.project_out = Linear(hidden, words, bias=False) if projected else None


class OPTModel(nn.Module):
    """Hugging Face's ``model`` level: holds the decoder."""

    def __init__(self, decoder: OPTDecoder):
        super().__init__()
        self.decoder = decoder


class OPTForCausalLM(DecoderForCausalLM):
    """OPT causal LMs (see the module docstring)."""

    LAYER_PREFIX = "model.decoder.layers."
    STAGE_WEIGHTS = ("model.decoder.embed_tokens.", "model.decoder.embed_positions.", "model.decoder.project_in.",
                     "model.decoder.final_layer_norm.", "model.decoder.project_out.", "lm_head.")
    ROW_PARALLEL = ("out_proj", "fc2")
    CARRIED_TENSORS = 1
    COLUMN_PARALLEL = ("fc1",)

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """Multi-head attention (as many KV heads as heads), a plain MLP of ``ffn_dim``."""
        heads = hf_config.num_attention_heads
        return ModelShape(hf_config.num_hidden_layers, heads, heads, hf_config.hidden_size // heads, None,
                          hf_config.max_position_embeddings, hf_config.vocab_size, hf_config.hidden_size,
                          hf_config.ffn_dim, tied_embeddings(hf_config), mlp_kind="plain")

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__(hf_config, attention, dtype, max_positions, parallel)
        self.model = OPTModel(OPTDecoder(hf_config, attention, parallel, self.needs_embedding()))
        self.finish_init(hf_config.word_embed_proj_dim, getattr(self.model.decoder, "embed_tokens", None), dtype)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """This stage's decoder layers."""
        return self.model.decoder.layers

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Token embeddings (through ``project_in``) plus learned positions."""
        decoder = self.model.decoder
        x = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            x = decoder.project_in(x)
        return (x + decoder.embed_positions(positions + POSITION_OFFSET),)

    def final_hidden(self, state: tuple) -> torch.Tensor:
        """The final norm (pre-norm models) and ``project_out`` of the last layer's output."""
        (h,), decoder = state, self.model.decoder
        if decoder.final_layer_norm is not None:
            h = decoder.final_layer_norm(h)
        return decoder.project_out(h) if decoder.project_out is not None else h


def model_specs() -> list[ComponentSpec]:
    """Registry entries for OPT."""
    return [ComponentSpec("model", name, OPTForCausalLM, None, "OPT decoder (learned positions, LayerNorm, ReLU MLP)")
            for name in ARCHITECTURES]
