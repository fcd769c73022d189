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

from typing import Any

import torch
from torch import nn

from servelab.core.component import ComponentSpec
from servelab.core.model import ModelParallel, ModelShape
from servelab.plugins.models.decoder import (DecoderForCausalLM, HeadSplit, RMSNorm, RotaryEmbedding, VocabEmbedding,
                                             WeightPiece, layer_windows_of, sliding_window_value, tied_embeddings,
                                             use_native)
from servelab.plugins.models.linear import Linear, linear_input
from servelab.plugins.models.native_decode_stack import NativeDecodeStack

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def head_dim_of(hf_config: Any) -> int:
    """The attention head size (explicit ``head_dim`` or hidden / heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def sliding_window_of(hf_config: Any) -> int | None:
    """The sliding attention window, or None for full attention (Qwen2 and Qwen3: only
    with ``use_sliding_window``, for the layers ``layer_types`` names)."""
    if hf_config.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not getattr(
            hf_config, "use_sliding_window", False):
        return None
    return sliding_window_value(hf_config)


def per_layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's window where the config gives one per layer (Qwen2 and Qwen3 with
    ``use_sliding_window``: ``layer_types``, from ``max_window_layers``); empty otherwise."""
    if sliding_window_of(hf_config) is None or not getattr(hf_config, "layer_types", None):
        return ()
    return layer_windows_of(hf_config)


def activation_of(hf_config: Any) -> str:
    """The MLP's activation name: ``hidden_activation`` (Gemma's field) or ``hidden_act``."""
    return getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act


class DecoderAttention(nn.Module):
    """Fused qkv projection, per-head q/k norm (``qk_norm``: Qwen3, Gemma 3), rotary
    embedding, backend attention; this rank's heads under tensor parallelism (``split``)."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel, qk_norm: bool = False):
        super().__init__()
        total_heads = hf_config.num_attention_heads
        total_kv = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(hf_config)
        self.split = HeadSplit.of(total_heads, total_kv, self.head_dim, parallel)
        self.num_heads, self.num_kv_heads = len(self.split.heads), len(self.split.kv_heads)
        self.parallel = parallel
        qkv_bias = (bool(getattr(hf_config, "attention_bias", False) or getattr(hf_config, "qkv_bias", False))
                    or hf_config.model_type == "qwen2")
        o_bias = bool(getattr(hf_config, "attention_bias", False))
        self.q_size, self.kv_size = self.split.q_size, self.split.kv_size
        self.qkv_proj = Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)
        self.qk_norm = qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.layer_index = layer_index
        self.attention = attention
        self.rotary = rotary

    def fused_counts(self) -> dict[str, int]:
        """``qkv_proj``'s parameters are filled by three pieces (q, k, v)."""
        return {"qkv_proj": 3}

    def pieces(self, leaf: str, tensor: torch.Tensor) -> list[WeightPiece] | None:
        """This rank's rows of q/k/v_proj (or of a checkpoint's fused qkv_proj)."""
        return self.split.qkv_pieces(leaf, tensor)

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


def gated_activation(gate_up: torch.Tensor, act: Any, fused_silu: bool) -> torch.Tensor:
    """gate_up: [T, 2 * I] as [gate | up] -> act(gate) * up [T, I]; the native CPU op when
    ``fused_silu`` (the activation is silu), into a tensor the next ``Linear`` reads without a copy."""
    intermediate = gate_up.shape[-1] // 2
    if fused_silu and use_native(gate_up):
        hidden = linear_input(gate_up.shape[0], intermediate, gate_up)
        torch.ops.servelab_cpu.silu_and_mul(hidden, gate_up)
        return hidden
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection; this rank's ``columns`` of the
    intermediate size (``intermediate_size``, else the config's) under tensor parallelism,
    summed over the ranks unless ``reduce`` is False (the caller then sums the partial
    output: a mixture of experts' shared expert, with the routed ones)."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, intermediate_size: int | None = None,
                 reduce: bool = True):
        super().__init__()
        bias = bool(getattr(hf_config, "mlp_bias", False))
        self.columns = parallel.split(intermediate_size or hf_config.intermediate_size)
        self.reduce = reduce
        self.intermediate = len(self.columns)
        self.parallel = parallel
        self.gate_up_proj = Linear(hf_config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, hf_config.hidden_size, bias=bias)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[activation_of(hf_config)]
        self.fused_silu = activation_of(hf_config) == "silu"

    def fused_counts(self) -> dict[str, int]:
        """``gate_up_proj``'s parameters are filled by two pieces (gate, up)."""
        return {"gate_up_proj": 2}

    def pieces(self, leaf: str, tensor: torch.Tensor) -> list[WeightPiece] | None:
        """This rank's columns of gate_proj / up_proj (or of a checkpoint's fused
        gate_up_proj, [gate | up])."""
        source, _, suffix = leaf.partition(".")
        param, rows = f"gate_up_proj.{suffix}", slice(self.columns.start, self.columns.stop)
        if source == "gate_up_proj":
            gate, up = tensor.chunk(2)
            return [WeightPiece(param, 0, gate[rows]), WeightPiece(param, self.intermediate, up[rows])]
        if source in ("gate_proj", "up_proj"):
            return [WeightPiece(param, 0 if source == "gate_proj" else self.intermediate, tensor[rows])]
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        out = self.down_proj(gated_activation(self.gate_up_proj(x), self.act, self.fused_silu))
        return self.parallel.all_reduce(out) if self.reduce and self.parallel.tp_size > 1 else out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                 parallel: ModelParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.self_attn = self.build_attention(hf_config, layer_index, attention, rotary, parallel)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.mlp = self.build_mlp(hf_config, layer_index, parallel)

    def build_attention(self, hf_config: Any, layer_index: int, attention: Any, rotary: RotaryEmbedding,
                        parallel: ModelParallel) -> nn.Module:
        """The layer's attention: fused q/k/v (Qwen3 and Qwen3-MoE: with q/k norms)."""
        return DecoderAttention(hf_config, layer_index, attention, rotary, parallel,
                                qk_norm=hf_config.model_type in ("qwen3", "qwen3_moe"))

    def build_mlp(self, hf_config: Any, layer_index: int, parallel: ModelParallel) -> nn.Module:
        """The layer's MLP (``layer_index``: its index in this pipeline stage): gated, fused gate/up."""
        return GatedMLP(hf_config, parallel)

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


class DecoderModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers (``layer_cls``), final norm (last
    stage), under Hugging Face's ``model.`` prefix."""

    def __init__(self, hf_config: Any, attention: Any, rotary: RotaryEmbedding, parallel: ModelParallel,
                 embedding: bool, layer_cls: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        if embedding:
            self.embed_tokens = VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size, parallel)
        self.layers = nn.ModuleList(layer_cls(hf_config, local, attention, rotary, parallel)
                                    for local, _ in enumerate(parallel.layer_range(hf_config.num_hidden_layers)))
        if parallel.is_last_stage:
            self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class LlamaFamilyForCausalLM(DecoderForCausalLM):
    """Llama, Mistral, Qwen2 and Qwen3 causal LMs (see the module docstring)."""

    ROW_PARALLEL = ("o_proj", "down_proj")
    LAYER: type[DecoderLayer] = DecoderLayer
    """The decoder layer's class."""

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """Sizes from the config (explicit ``head_dim`` wins over hidden / heads)."""
        heads = hf_config.num_attention_heads
        return ModelShape(hf_config.num_hidden_layers, heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                          head_dim_of(hf_config), sliding_window_of(hf_config), hf_config.max_position_embeddings,
                          hf_config.vocab_size, hf_config.hidden_size, hf_config.intermediate_size,
                          tied_embeddings(hf_config), layer_windows=per_layer_windows(hf_config))

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__(hf_config, attention, dtype, max_positions, parallel)
        self.rotary = RotaryEmbedding(hf_config, head_dim_of(hf_config), max_positions, dtype)
        self.model = DecoderModel(hf_config, attention, self.rotary, parallel, self.needs_embedding(), self.LAYER)
        self.finish_init(hf_config.hidden_size, getattr(self.model, "embed_tokens", None), dtype)
        self.rotary.to(dtype)
        self._native_stack: NativeDecodeStack | None | bool = False
        self.single_stage = parallel.is_first_stage and parallel.is_last_stage

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """This stage's decoder layers."""
        return self.model.layers

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The embedded tokens and no residual yet."""
        return self.model.embed_tokens(input_ids), None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: Any, carried: tuple[torch.Tensor, ...] | None = None) -> Any:
        """As ``DecoderForCausalLM.forward``; on one stage, a step the native stack serves runs
        whole (embedding, layers, final norm) in its one call."""
        stack = self._whole_step_stack(input_ids, attn_meta) if carried is None else None
        if stack is not None:
            return stack.model_hidden(input_ids, self.model.embed_tokens.weight, self.model.norm, positions,
                                      kv_caches, attn_meta)[0]
        return super().forward(input_ids, positions, kv_caches, attn_meta, carried)

    def hidden_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                          attn_meta: Any, logits_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``CausalLM.hidden_and_logits``; where the native stack serves the step and every
        row needs its logits, the LM head runs in the stack's call too."""
        stack = self._whole_step_stack(input_ids, attn_meta) if logits_rows is None else None
        if stack is None:
            hidden = self(input_ids, positions, kv_caches, attn_meta)
            return hidden, self.compute_logits(hidden if logits_rows is None else hidden[logits_rows])
        hidden, logits = stack.model_hidden(input_ids, self.model.embed_tokens.weight, self.model.norm, positions,
                                            kv_caches, attn_meta, self.vocab_size)
        return hidden, self.compute_logits(hidden) if logits is None else logits

    def greedy_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                     attn_meta: Any, steps: int) -> torch.Tensor | None:
        """As ``CausalLM.greedy_steps``: in the native stack's one call, where it serves the
        step with its LM head."""
        stack = self._whole_step_stack(input_ids, attn_meta)
        if stack is None:
            return None
        return stack.greedy_steps(input_ids, self.model.embed_tokens.weight, self.model.norm, positions, kv_caches,
                                  attn_meta, self.vocab_size, steps)

    def _whole_step_stack(self, input_ids: torch.Tensor, attn_meta: Any) -> NativeDecodeStack | None:
        """The native stack where it can run this whole step (one stage, rows it serves), else None."""
        stack = self.native_stack()
        if (stack is not None and self.single_stage and self.model.embed_tokens.weight.dtype == stack.dtype
                and stack.serves(input_ids.shape[0], attn_meta)):
            return stack
        return None

    def native_stack(self) -> NativeDecodeStack | None:
        """The decoder layers as one native call (``NativeDecodeStack``), None where it cannot serve them."""
        if self._native_stack is False:  # not worked out yet (after the weights are loaded)
            self._native_stack = NativeDecodeStack.of(self)
        return self._native_stack

    def run_layers(self, state: tuple, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: Any) -> tuple:
        """The layers through ``NativeDecodeStack`` (one native call) where it serves the step,
        else one after the other."""
        stack = self.native_stack()
        if stack is not None and state[0].dtype == stack.dtype and stack.serves(state[0].shape[0], attn_meta):
            return stack(state, positions, kv_caches, attn_meta)
        return super().run_layers(state, positions, kv_caches, attn_meta)

    def final_hidden(self, state: tuple) -> torch.Tensor:
        """The final norm of the last layer's output plus its residual."""
        x, residual = state
        return self.model.norm.add_forward(x, residual)[0]


def model_specs() -> list[ComponentSpec]:
    """Registry entries: every supported architecture name maps to the same class."""
    return [ComponentSpec("model", name, LlamaFamilyForCausalLM, None, "Llama-family decoder (flat batches)")
            for name in ARCHITECTURES]
