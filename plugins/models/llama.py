"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) on flat token batches.

Differences between the members are read from the checkpoint's config: Qwen2 has q/k/v
biases, Qwen3 normalises q and k per head and may set ``head_dim`` explicitly, Mistral
may use a sliding window, and any of them may tie the embeddings. q/k/v and gate/up
projections are fused into one matmul each.

Tensor parallelism (Megatron-style) splits each rank's query heads, KV heads (or
replicates a KV head among the ranks that share it when there are fewer KV heads than
ranks), gate/up columns and vocabulary rows; the output and down projections take the
matching input columns and sum over the ranks with one all-reduce each; the embedding
sums the rows each rank holds; the LM head's logits are gathered. Pipeline parallelism
gives each stage consecutive layers; the first embeds, the last normalises and computes
logits, and the residual stream travels between stages.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.model import CausalLM, ModelParallel, ModelShape
from servelab.plugins.models.linear import Linear, linear_input, warm_up_linears
from servelab.plugins.models.quantized_linear import pack_quantized_linears
from servelab.plugins.models.layers import RMSNorm, RotaryEmbedding, use_native

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def head_dim_of(hf_config: Any) -> int:
    """The attention head size (explicit ``head_dim`` or hidden / heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def sliding_window_of(hf_config: Any) -> int | None:
    """The sliding attention window, or None for full attention."""
    if hf_config.model_type in ("qwen2", "qwen3"):
        if getattr(hf_config, "use_sliding_window", False):
            raise ConfigError([f"{hf_config.model_type} with use_sliding_window=true is not supported"])
        return None
    return getattr(hf_config, "sliding_window", None)


class DecoderAttention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm, rotary embedding, backend attention;
    this rank's heads under tensor parallelism (``heads``, ``kv_heads``: the global head
    indices it holds)."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel):
        super().__init__()
        total_heads = hf_config.num_attention_heads
        total_kv = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(hf_config)
        self.heads = parallel.split(total_heads)
        first_kv = self.heads.start * total_kv // total_heads
        self.kv_heads = range(first_kv, first_kv + max(1, total_kv // parallel.tp_size))
        self.num_heads, self.num_kv_heads = len(self.heads), len(self.kv_heads)
        self.parallel = parallel
        qkv_bias = bool(getattr(hf_config, "attention_bias", False)) or hf_config.model_type == "qwen2"
        o_bias = bool(getattr(hf_config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)
        self.qk_norm = hf_config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.layer_index = layer_index
        self.attention = attention
        self.rotary = rotary

    def shard_sizes(self, name: str) -> tuple[int, ...]:
        """Row sizes of the fused projection's shards."""
        return (self.q_size, self.kv_size, self.kv_size)

    def rows(self, source: str) -> range:
        """The rows of checkpoint weight ``source`` (q/k/v_proj) this rank holds."""
        heads = self.heads if source == "q_proj" else self.kv_heads
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.layer_index)
        out = self.o_proj(out.reshape(tokens, self.q_size))
        return self.parallel.all_reduce(out) if self.parallel.tp_size > 1 else out


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection; this rank's ``columns`` of the
    intermediate size under tensor parallelism."""

    def __init__(self, hf_config: Any, parallel: ModelParallel):
        super().__init__()
        bias = bool(getattr(hf_config, "mlp_bias", False))
        self.columns = parallel.split(hf_config.intermediate_size)
        self.intermediate = len(self.columns)
        self.parallel = parallel
        self.gate_up_proj = Linear(hf_config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, hf_config.hidden_size, bias=bias)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[hf_config.hidden_act]
        self.fused_silu = hf_config.hidden_act == "silu"

    def shard_sizes(self, name: str) -> tuple[int, ...]:
        """Row sizes of the fused projection's shards."""
        return (self.intermediate, self.intermediate)

    def rows(self, source: str) -> range:
        """The rows of checkpoint weight ``source`` (gate/up_proj) this rank holds."""
        return self.columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)
        if self.fused_silu and use_native(gate_up):
            hidden = linear_input(gate_up.shape[0], self.intermediate, gate_up)
            torch.ops.servelab_cpu.silu_and_mul(hidden, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act(gate) * up
        out = self.down_proj(hidden)
        return self.parallel.all_reduce(out) if self.parallel.tp_size > 1 else out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = DecoderAttention(hf_config, layer_index, attention, rotary, parallel)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.mlp = GatedMLP(hf_config, parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it), both [T, hidden];
        the next layer (or the final norm) adds them. ``residual`` is None for the first layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


class VocabEmbedding(nn.Module):
    """The token embedding over this rank's ``vocab`` rows: tokens of other ranks embed to
    zeros and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ModelParallel):
        super().__init__()
        self.vocab = parallel.padded_split(vocab_size)
        self.parallel = parallel
        self.weight = nn.Parameter(torch.empty(len(self.vocab), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden]."""
        if self.parallel.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab.start) | (input_ids >= self.vocab.stop)
        local = (input_ids - self.vocab.start).masked_fill(outside, 0)
        return self.parallel.all_reduce(nn.functional.embedding(local, self.weight).masked_fill(outside[:, None], 0))


class DecoderModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers, final norm (last stage), under
    Hugging Face's ``model.`` prefix; ``layer_indices`` are the layers' global indices."""

    def __init__(self, hf_config: Any, attention: Any, rotary: RotaryEmbedding, parallel: ModelParallel):
        super().__init__()
        self.layer_indices = parallel.layer_range(hf_config.num_hidden_layers)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if parallel.is_first_stage or (tied and parallel.is_last_stage):
            self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(hf_config, local, attention, rotary, parallel)
                                    for local, _ in enumerate(self.layer_indices))
        if parallel.is_last_stage:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaFamilyForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 and Qwen3 causal LMs (see the module docstring)."""

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """Sizes from the config (explicit ``head_dim`` wins over hidden / heads)."""
        heads = hf_config.num_attention_heads
        return ModelShape(hf_config.num_hidden_layers, heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                          head_dim_of(hf_config), sliding_window_of(hf_config), hf_config.max_position_embeddings,
                          hf_config.vocab_size, hf_config.hidden_size, hf_config.intermediate_size,
                          bool(getattr(hf_config, "tie_word_embeddings", False)))

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__(hf_config, attention, dtype, max_positions, parallel)
        self.hf_config = hf_config
        self.parallel = parallel
        self.vocab_size = hf_config.vocab_size
        self.rotary = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_positions, dtype)
        self.model = DecoderModel(hf_config, attention, self.rotary, parallel)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.is_last_stage = parallel.is_last_stage
        if parallel.is_last_stage:
            vocab = parallel.padded_split(hf_config.vocab_size)
            self.lm_head = Linear(hf_config.hidden_size, len(vocab), bias=False)
            if self.tie_word_embeddings:  # one parameter, named model.embed_tokens.weight; still packed
                self.lm_head.weight = self.model.embed_tokens.weight
        self.to(dtype)
        self.rotary.to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up and keeping this rank's
        share and this stage's layers; every parameter must be set. Quantized layers
        (``QuantizedLinear``) take their ``qweight`` / ``scales`` / ``zeros`` the same way:
        each row of them belongs to one output feature."""
        params = dict(self.named_parameters())
        pending = {name: 1 for name in params}
        for name in params:
            layer = name.rpartition(".")[0]
            if layer.endswith("qkv_proj"):
                pending[name] = 3
            elif layer.endswith("gate_up_proj"):
                pending[name] = 2
        layers = self.model.layer_indices
        with torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name.startswith("model.layers."):
                    index = int(name.split(".")[2])
                    if index not in layers:
                        continue
                    name = name.replace(f"model.layers.{index}.", f"model.layers.{index - layers.start}.", 1)
                elif name not in params and name.startswith(("model.embed_tokens.", "model.norm.", "lm_head.")):
                    continue  # held by another pipeline stage
                self._load_one(params, pending, name, tensor)
        missing = sorted(n for n, count in pending.items() if count > 0)
        if missing:
            raise ConfigError([f"checkpoint is missing weights: {', '.join(missing[:8])}"])

    def _load_one(self, params: dict, pending: dict, name: str, tensor: torch.Tensor) -> None:
        parts = name.split(".")
        for source, (target, shard) in _STACKED.items():
            if source in parts:
                target_name = name.replace(source, target)
                module = self.get_submodule(".".join(parts[:-2]))
                sizes = module.shard_sizes(target)
                start = sum(sizes[:shard])
                rows = module.rows(source)
                params[target_name][start:start + sizes[shard]].copy_(tensor[rows.start:rows.stop])
                pending[target_name] -= 1
                return
        if name not in params:
            raise ConfigError([f"checkpoint weight {name!r} has no place in {type(self).__name__}"])
        tensor = self._share(name, tensor, params[name])
        if params[name].shape != tensor.shape:
            raise ConfigError([f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                               f"expected {tuple(params[name].shape)}"])
        params[name].copy_(tensor)
        pending[name] -= 1

    def _share(self, name: str, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of an unfused weight: vocabulary rows of the embedding and LM
        head (zero rows past the vocabulary), input columns of the output and down
        projections (of their 2-D quantized tensors too: int4 bytes and groups hold
        consecutive input features), their biases on rank 0 only (the all-reduce adds
        them once)."""
        parallel = self.parallel
        if parallel.tp_size == 1:
            return tensor
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            vocab = parallel.padded_split(self.vocab_size)
            part = torch.zeros_like(param)
            rows = tensor[vocab.start:min(vocab.stop, self.vocab_size)]
            part[:len(rows)] = rows
            return part
        if name.rpartition(".")[0].endswith(("o_proj", "down_proj")) and tensor.dim() == 2:
            columns = param.shape[1]
            return tensor[:, parallel.tp_rank * columns:(parallel.tp_rank + 1) * columns]
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            return tensor if parallel.tp_rank == 0 else torch.zeros_like(tensor)
        return tensor

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: Any, carried: tuple[torch.Tensor, ...] | None = None) -> Any:
        """input_ids, positions: [T] -> hidden states [T, hidden] on the last stage, else the
        (output, residual) pair the next stage carries on with."""
        if carried is None:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            x, residual = carried
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, attn_meta)
        if not self.is_last_stage:
            return x, residual
        return self.model.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab] (this rank's vocabulary rows,
        gathered from every tensor-parallel rank)."""
        logits = self.lm_head(hidden).float()
        return (self.parallel.all_gather(logits) if self.parallel.tp_size > 1 else logits)[:, :self.vocab_size]

    def warm_up(self, max_tokens: int) -> int:
        """Compile the prepacked CPU matmuls for every row bucket up to ``max_tokens`` and
        pack the quantized layers' weights for their CPU kernels."""
        return warm_up_linears(self, max_tokens) + pack_quantized_linears(self)


def model_specs() -> list[ComponentSpec]:
    """Registry entries: every supported architecture name maps to the same class."""
    return [ComponentSpec("model", name, LlamaFamilyForCausalLM, None, "Llama-family decoder (flat batches)")
            for name in ARCHITECTURES]
