"""DeepSeek-V2 (``DeepseekV2ForCausalLM``) and DeepSeek-V3 (``DeepseekV3ForCausalLM``) on
flat token batches: multi-head latent attention (MLA) in its absorbed form through the
ordinary attention backends, and dense MLPs in the first ``first_k_dense_replace`` layers,
mixtures of experts in the others.

Per token, ``kv_a_proj_with_mqa`` gives a latent ``c`` of ``kv_lora_rank`` features
(normalised by ``kv_a_layernorm``) and one rotary key of ``qk_rope_head_dim`` shared by all
heads. A head's key would be ``[W_UK c | k_rope]`` and its value ``W_UV c`` (``kv_b_proj``'s
key and value rows of that head); instead of decompressing them, each query head takes its
non-rotary part into the latent space, ``q_nope W_UK``, so the scores are
``[q_nope W_UK | q_rope] . [c | k_rope]``, and the attention output over the latents is
multiplied by ``W_UV`` afterwards. That is multi-query attention with one KV head of
``kv_lora_rank + qk_rope_head_dim`` (``ModelShape.attention_spec``) whose values are its
keys: the cache holds ``[c | k_rope]`` once per token, every backend reads the values out
of the keys (``AttentionSpec.values_are_keys``), and the layer keeps the first
``kv_lora_rank`` features of the output (the softmax-weighted latents).
The softmax scale is transformers': ``(qk_nope + qk_rope) ** -0.5``, times yarn's
``mscale ** 2`` when ``rope_parameters`` sets ``mscale_all_dim``.

DeepSeek rotates consecutive feature pairs (V2's complex multiplication, V3's
``rope_interleave``, its default); the rotary rows of
``q_proj`` / ``q_b_proj`` and ``kv_a_proj_with_mqa`` are reordered at load time to even
features then odd ones, so the shared rotate-half ``RotaryEmbedding`` (and its native CPU
op; of the config's ``head_dim``, which transformers sets to ``qk_rope_head_dim``) rotates
exactly those pairs; queries and keys are reordered alike, so the scores are
unchanged. A V3 config with ``rope_interleave=false`` rotates halves, as the shared
embedding does, and loads as it is. The layer is otherwise Llama's (pre-norm; a gated MLP
or the sparse block of ``moe.py``, whose router ``routing.py`` describes: V2's softmax with
an optional group-limited top-k, V3's sigmoid scores with the correction bias and groups
scored by their two best experts; shared experts added ungated).

Tensor parallelism splits the query heads (``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` by
rows, ``o_proj`` by input columns); the latent's projection and norm (and the query's
``q_a_proj`` / ``q_a_layernorm``) are whole on every rank, each caching the one latent
head. Pipeline parallelism is the shared decoder's.

The experts split as the other mixtures' do: each expert's intermediate size across the
tensor-parallel ranks, or whole experts per rank under expert parallelism. Layers past
``num_hidden_layers`` in a checkpoint (V3's multi-token-prediction layer) are not loaded,
as transformers leaves them.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from servelab.core.component import ComponentSpec
from servelab.core.model import LatentAttention, ModelParallel, ModelShape
from servelab.plugins.models.decoder import RMSNorm, RotaryEmbedding, rope_type_of, tied_embeddings
from servelab.plugins.models.linear import Linear
from servelab.plugins.models.moe import ExpertLayout, SparseDecoderLayer, SparseForCausalLM

LATENT_NORM_EPS = 1e-6
"""transformers builds ``q_a_layernorm`` and ``kv_a_layernorm`` with this eps, whatever
``rms_norm_eps`` says."""


def latent_of(hf_config: Any) -> LatentAttention:
    """The config's latent attention sizes."""
    return LatentAttention(hf_config.kv_lora_rank, hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim,
                           hf_config.v_head_dim, hf_config.q_lora_rank)


def attention_scale_of(hf_config: Any) -> float | None:
    """transformers' softmax scale when it is not ``(qk_nope + qk_rope) ** -0.5`` (None):
    yarn ``rope_parameters`` with ``mscale_all_dim`` multiply it by ``mscale ** 2``. An
    unsupported rope type is a ``ConfigError`` naming ``rope_scaling.rope_type``."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type_of(params)
    default = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    scale = yarn_apply_mscale(params, default)
    return None if scale == default else scale


class LatentProjection(nn.Module):
    """``kv_b_proj``'s weight for this rank's heads, [heads * (qk_nope + v), kv_lora_rank]:
    never applied to the latent, but used to take queries into the latent space
    (``absorb``) and attention outputs out of it (``expand``)."""

    def __init__(self, latent: LatentAttention, heads: int):
        super().__init__()
        self.heads, self.nope, self.v = heads, latent.qk_nope_head_dim, latent.v_head_dim
        self.weight = nn.Parameter(torch.empty(heads * (self.nope + self.v), latent.kv_lora_rank))

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope: [T, H, qk_nope] -> [T, H, kv_lora_rank] (each head times its W_UK)."""
        w_uk = self.weight.view(self.heads, self.nope + self.v, -1)[:, :self.nope]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand(self, out: torch.Tensor) -> torch.Tensor:
        """out: [T, H, kv_lora_rank] -> [T, H * v_head_dim] (each head times its W_UV)."""
        w_uv = self.weight.view(self.heads, self.nope + self.v, -1)[:, self.nope:]
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)


class LatentAttentionBlock(nn.Module):
    """MLA in the absorbed form (see the module docstring) over this rank's query heads."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel):
        super().__init__()
        self.latent = latent = latent_of(hf_config)
        hidden, bias = hf_config.hidden_size, bool(getattr(hf_config, "attention_bias", False))
        self.num_heads = len(parallel.split(hf_config.num_attention_heads))
        q_width = self.num_heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim)
        if latent.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = Linear(hidden, latent.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(latent.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(latent.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, latent.cached_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(latent.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(latent, self.num_heads)
        self.o_proj = Linear(self.num_heads * latent.v_head_dim, hidden, bias=bias)
        self.layer_index = layer_index
        self.attention = attention
        self.rotary = rotary
        self.parallel = parallel

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        tokens, latent = x.shape[0], self.latent
        rank, nope, rope = latent.kv_lora_rank, latent.qk_nope_head_dim, latent.qk_rope_head_dim
        q = self.q_proj(x) if latent.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, self.num_heads, nope + rope).split((nope, rope), dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split((rank, rope), dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope.unsqueeze(1))
        query = torch.cat((self.kv_b_proj.absorb(q_nope), q_rope), dim=-1)
        key = torch.cat((c, k_rope.squeeze(1)), dim=-1).unsqueeze(1)
        out = self.attention.forward(query, key, key, kv_cache, meta, self.layer_index)
        out = self.o_proj(self.kv_b_proj.expand(out.view(tokens, self.num_heads, -1)[..., :rank]))
        return self.parallel.all_reduce(out) if self.parallel.tp_size > 1 else out


class LatentDecoderLayer(SparseDecoderLayer):
    """Llama's pre-norm layer around latent attention, with a dense MLP or a mixture of
    experts."""

    def build_attention(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                        parallel: ModelParallel) -> nn.Module:
        """MLA (``LatentAttentionBlock``)."""
        return LatentAttentionBlock(hf_config, layer_index, attention, rotary, parallel)


class DeepseekV2ForCausalLM(SparseForCausalLM):
    """DeepSeek-V2 and DeepSeek-V3 (see the module docstring)."""

    LAYER = LatentDecoderLayer
    COLUMN_PARALLEL = ("q_proj", "q_b_proj", "kv_b_proj")
    EXPERT_ALIASES: dict[str, str] = {}

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """Sizes with the latent attention (``head_dim``: the query-key width, nope + rope;
        as many KV heads as the config's decompressed ones), transformers' softmax scale,
        and the mixture of experts as ``ExpertLayout.priced`` describes it; a routing that
        cannot run is a ``ConfigError`` naming its fields."""
        latent = latent_of(hf_config)
        heads = hf_config.num_attention_heads
        shape = ModelShape(hf_config.num_hidden_layers, heads, hf_config.num_key_value_heads or heads,
                           latent.qk_nope_head_dim + latent.qk_rope_head_dim, None,
                           hf_config.max_position_embeddings, hf_config.vocab_size, hf_config.hidden_size,
                           hf_config.intermediate_size, tied_embeddings(hf_config),
                           attention_scale=attention_scale_of(hf_config), latent=latent)
        return ExpertLayout.of(hf_config).priced(shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The sparse loader, the shared experts (``mlp.shared_experts``) read as the block's
        ``shared_expert`` and, where DeepSeek rotates consecutive pairs, the rotary rows of
        the query and latent projections (float or quantized) reordered even features first
        (see the module docstring)."""
        latent = latent_of(self.hf_config)
        rope = latent.qk_rope_head_dim
        widths = {"q_proj": latent.qk_nope_head_dim + rope, "q_b_proj": latent.qk_nope_head_dim + rope,
                  "kv_a_proj_with_mqa": latent.cached_width}
        groups = {f"{layer}.{kind}": width for layer, width in widths.items() for kind in ROWED
                  } if getattr(self.hf_config, "rope_interleave", True) else {}
        super().load_weights((name.replace(".mlp.shared_experts.", ".mlp.shared_expert."),
                              deinterleaved(tensor, groups[leaf], rope) if (leaf := _leaf(name)) in groups
                              else tensor) for name, tensor in weights)


ROWED = ("weight", "bias", "qweight", "scales", "zeros")
"""A linear layer's tensors with a row per output feature, float or quantized."""


def _leaf(name: str) -> str:
    """``a.b.q_proj.weight`` -> ``q_proj.weight``."""
    return ".".join(name.split(".")[-2:])


def deinterleaved(tensor: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """``tensor``'s rows in groups of ``width`` (one per head, or the one latent), each
    group's last ``rope`` rows reordered: even ones first, then odd ones."""
    groups = tensor.unflatten(0, (-1, width))
    nope, rotary = groups[:, :width - rope], groups[:, width - rope:]
    return torch.cat((nope, rotary[:, 0::2], rotary[:, 1::2]), dim=1).flatten(0, 1)


def model_specs() -> list[ComponentSpec]:
    """Registry entries for DeepSeek-V2 and DeepSeek-V3."""
    return [ComponentSpec("model", "DeepseekV2ForCausalLM", DeepseekV2ForCausalLM, None,
                          "DeepSeek-V2 decoder, multi-head latent attention (absorbed), softmax-routed experts"),
            ComponentSpec("model", "DeepseekV3ForCausalLM", DeepseekV2ForCausalLM, None,
                          "DeepSeek-V3 decoder, multi-head latent attention (absorbed), sigmoid-routed grouped "
                          "experts with correction bias")]
