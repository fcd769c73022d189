"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's text model (``Gemma3ForCausalLM``) on flat
token batches.

Both share one layer: RMSNorms that scale by ``1 + weight`` before and after the attention
and before and after the MLP (four per layer), a gated MLP with ``hidden_activation``
(``gelu_pytorch_tanh``), token embeddings multiplied by sqrt(hidden_size) rounded to the
model's dtype, an LM head tied to the embedding (``tie_word_embeddings``), and softmax
scale ``query_pre_attn_scalar ** -0.5``. ``layer_types`` says which layers attend over a
``sliding_window`` (``sliding_attention``) and which over the whole context
(``full_attention``): ``ModelShape.layer_windows`` declares it per layer. Gemma 2
soft-caps the attention scores (``attn_logit_softcapping``, ``AttentionSpec.softcap``);
either may soft-cap the logits (``final_logit_softcapping``). Gemma 3 normalises q and k
per head and rotates each layer type with its own ``rope_parameters`` entry (local and
global bases); its ``attn_logit_softcapping`` is not applied, as transformers' Gemma 3
attention does not apply it.

The norms' ``1 + weight`` is added once at load time (in float32), so the layers run the
shared RMSNorm and its native CPU op; in float32 that is the same arithmetic, in bfloat16
the stored ``1 + weight`` rounds to bfloat16 where transformers multiplies in float32.
Tensor and pipeline parallelism split heads, MLP columns and layers as in the Llama
family (``llama.py``, whose attention and MLP modules these layers use).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.model import ModelParallel, ModelShape
from servelab.plugins.attention.softcap import capped
from servelab.plugins.models.decoder import (LAYER_TYPES, DecoderForCausalLM, RMSNorm, RotaryEmbedding,
                                             VocabEmbedding, layer_types_of, layer_windows_of, tied_embeddings)
from servelab.plugins.models.llama import DecoderAttention, GatedMLP, head_dim_of

class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm, residual add; norm, MLP, norm, residual add."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel, qk_norm: bool):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DecoderAttention(hf_config, layer_index, attention, rotary, parallel, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hf_config, parallel)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normed MLP output, the residual stream before it), both
        [T, hidden]; the next layer (or the final norm) adds them. ``residual`` is None for
        the first layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_forward(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    """Embedding (first stage), this stage's layers, each rotating with its layer type's
    ``rotaries`` entry, and the final norm (last stage), under Hugging Face's ``model.``
    prefix."""

    def __init__(self, hf_config: Any, attention: Any, rotaries: dict[str, RotaryEmbedding], parallel: ModelParallel,
                 embedding: bool, qk_norm: bool):
        super().__init__()
        if embedding:
            self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, parallel)
        types = layer_types_of(hf_config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, local, attention, rotaries[types[index]], parallel, qk_norm)
            for local, index in enumerate(parallel.layer_range(hf_config.num_hidden_layers)))
        if parallel.is_last_stage:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class GemmaForCausalLM(DecoderForCausalLM):
    """What Gemma 2 and Gemma 3 share (see the module docstring); the subclasses say
    whether q and k are normalised (``QK_NORM``), whether each layer type has its own
    rotary parameters (``ROPE_BY_LAYER_TYPE``) and whether attention scores are
    soft-capped (``CAPS_ATTENTION``)."""

    ROW_PARALLEL = ("o_proj", "down_proj")
    QK_NORM = False
    ROPE_BY_LAYER_TYPE = False
    CAPS_ATTENTION = False

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """Sizes, per-layer windows, the attention scale and soft cap; refuses
        bidirectional attention."""
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ConfigError([f"{hf_config.model_type} with use_bidirectional_attention=true is not supported "
                               "(servelab's attention is causal)"])
        heads = hf_config.num_attention_heads
        windows = layer_windows_of(hf_config)
        window = next((w for w in windows if w is not None), None)
        softcap = hf_config.attn_logit_softcapping if cls.CAPS_ATTENTION else None
        return ModelShape(hf_config.num_hidden_layers, heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                          head_dim_of(hf_config), window, hf_config.max_position_embeddings, hf_config.vocab_size,
                          hf_config.hidden_size, hf_config.intermediate_size, tied_embeddings(hf_config),
                          layer_windows=windows, attention_scale=hf_config.query_pre_attn_scalar ** -0.5,
                          attention_softcap=softcap)

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__(hf_config, attention, dtype, max_positions, parallel)
        head_dim = head_dim_of(hf_config)
        if self.ROPE_BY_LAYER_TYPE:
            self.rotary = nn.ModuleDict({kind: RotaryEmbedding(hf_config, head_dim, max_positions, dtype, kind)
                                         for kind in sorted(set(layer_types_of(hf_config)))})
            rotaries = dict(self.rotary.items())
        else:
            self.rotary = RotaryEmbedding(hf_config, head_dim, max_positions, dtype)
            rotaries = dict.fromkeys(LAYER_TYPES, self.rotary)
        self.model = GemmaModel(hf_config, attention, rotaries, parallel, self.needs_embedding(), self.QK_NORM)
        self.register_buffer("embed_scale", torch.tensor(hf_config.hidden_size ** 0.5).to(dtype), persistent=False)
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)
        self.finish_init(hf_config.hidden_size, getattr(self.model, "embed_tokens", None), dtype)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """This stage's decoder layers."""
        return self.model.layers

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The embedded tokens times sqrt(hidden_size), and no residual yet."""
        return self.model.embed_tokens(input_ids) * self.embed_scale, None

    def final_hidden(self, state: tuple) -> torch.Tensor:
        """The final norm of the last layer's output plus its residual."""
        x, residual = state
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits, soft-capped at ``final_logit_softcapping`` when set."""
        return capped(super().compute_logits(hidden), self.final_softcap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The shared loader, each norm weight ``w`` loaded as ``1 + w`` (in float32)."""
        super().load_weights((name, tensor.float() + 1 if name.endswith("norm.weight") else tensor)
                             for name, tensor in weights)


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: one rotary embedding for every layer, soft-capped attention scores."""

    CAPS_ATTENTION = True


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3's text model: q/k norms, rotary parameters per layer type."""

    QK_NORM = True
    ROPE_BY_LAYER_TYPE = True


def model_specs() -> list[ComponentSpec]:
    """Registry entries for Gemma 2 and Gemma 3 (text)."""
    return [ComponentSpec("model", "Gemma2ForCausalLM", Gemma2ForCausalLM, None,
                          "Gemma 2 decoder (sliding/global layers, soft-capped attention and logits)"),
            ComponentSpec("model", "Gemma3ForCausalLM", Gemma3ForCausalLM, None,
                          "Gemma 3 text decoder (sliding/global layers, q/k norms, rope per layer type)")]
