"""What every decoder-only family shares: RMSNorm and rotary embeddings (LayerNorm is
torch's ``nn.LayerNorm``, there is no native op for it; the linear layer is
``servelab.plugins.models.linear.Linear``), the vocabulary embedding, the LM head (tied or
not), this pipeline stage's layers, the forward loop over them, and the weight loader.

A family subclasses ``DecoderForCausalLM`` and builds its modules with Hugging Face's
names, so that checkpoint tensors land on parameters of the same name; it says where its
layers sit in the checkpoint (``LAYER_PREFIX``), which other tensors only some stages
hold (``STAGE_WEIGHTS``), and how tensor parallelism splits its unfused linear layers
(``ROW_PARALLEL``: input columns, the bias added by rank 0 alone; ``COLUMN_PARALLEL``:
output rows). A module that fuses or reorders checkpoint tensors (q/k/v into one matmul,
Falcon's interleaved ``query_key_value``) has a ``pieces(leaf, tensor)`` method that
returns the ``WeightPiece``s this rank keeps, and ``fused_counts()``: how many pieces
each fused child's parameters wait for. Every parameter must be filled exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from servelab.core.errors import ConfigError
from servelab.core.model import CausalLM, ModelParallel
from servelab.kernels.cpu_ops import native_cpu_available
from servelab.plugins.models.linear import Linear, warm_up_linears
from servelab.plugins.models.quantized_linear import pack_quantized_linears



def use_native(x: torch.Tensor) -> bool:
    """True when ``x`` is on the CPU and servelab's native CPU ops are built."""
    return x.device.type == "cpu" and native_cpu_available()


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type_of(params: dict, field: str = "rope_scaling") -> str:
    """The rotary type of ``rope_parameters`` (or one layer type's entry of them), checked
    against ``SUPPORTED_ROPE_TYPES``; ``field`` names them in the error."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError([f"{field}.rope_type {rope_type!r} is not supported; supported: "
                           f"{', '.join(SUPPORTED_ROPE_TYPES)}"])
    return rope_type


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32, as the Llama family defines it.

    On the CPU, 2-D contiguous inputs take the native op, which rounds exactly where the
    torch formula does; per-head norms of a 3-D view (Qwen3's q/k norms) take it on a
    contiguous copy of their rows."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size] -> same shape and dtype."""
        if use_native(x) and (x.dim() == 3 or x.dim() == 2 and x.is_contiguous()):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            out = torch.empty_like(rows)
            torch.ops.servelab_cpu.rms_norm(out, rows, self.weight, self.eps)
            return out.view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual connection and the norm of its result: returns (norm(x + residual),
        x + residual). The native op reuses ``x`` and ``residual`` as outputs."""
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and use_native(x):
            torch.ops.servelab_cpu.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table over ``max_positions``.

    The inverse frequencies come from the checkpoint's ``rope_parameters`` (default,
    linear, llama3, yarn and longrope scaling), computed exactly as the reference
    implementation; ``partial_rotary_factor`` rotates the first ``rotary_dim`` features
    of each head and passes the rest through. longrope's short factors give the rows of
    positions below ``original_max_position_embeddings`` and its long factors the rest:
    transformers switches a whole forward pass to the long factors once its last position
    passes that length, which equals this table for prompts up to it (the decode steps
    past it rotate with the long factors in both). ``layer_type`` picks one entry of
    ``rope_parameters`` keyed by layer type (Gemma 3: ``sliding_attention`` and
    ``full_attention`` rotate with different bases).
    """

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, dtype: torch.dtype,
                 layer_type: str | None = None):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        field = "rope_scaling"
        if layer_type is not None:
            params, field = params.get(layer_type) or {}, f"rope_parameters.{layer_type}"
        rope_type = rope_type_of(params, field)
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * factor)
        positions = torch.arange(max_positions, dtype=torch.long)[:, None].float()
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            dim = self.rotary_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            freqs, scaling = positions * inv_freq.float(), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            by_type = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **by_type)
            freqs = positions * inv_freq.float()
            if rope_type == "longrope":
                original = params["original_max_position_embeddings"]
                long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=original + 1,
                                                              **by_type)
                freqs[original:] = positions[original:] * long_freq.float()
        table = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (table.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (table.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H, D]; k: [T, Hkv, D]. Returns rotated (q, k); the native
        CPU op rotates them in place (their first ``rotary_dim`` features)."""
        rot = self.rotary_dim
        if use_native(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            torch.ops.servelab_cpu.rotary_embedding(q[..., :rot], k[..., :rot], positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if rot == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        return (torch.cat((_rotate(q[..., :rot], cos, sin), q[..., rot:]), dim=-1),
                torch.cat((_rotate(k[..., :rot], cos, sin), k[..., rot:]), dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``layer_types`` entries of windowed configs (Gemma, Qwen2, Qwen3): a windowed layer and a global one."""


def layer_types_of(hf_config: Any) -> tuple[str, ...]:
    """Each layer's type, checked: one entry per layer, each one of ``LAYER_TYPES``."""
    types = tuple(hf_config.layer_types)
    if len(types) != hf_config.num_hidden_layers:
        raise ConfigError([f"layer_types has {len(types)} entries; expected one per layer "
                           f"(num_hidden_layers={hf_config.num_hidden_layers})"])
    wrong = [f"layer_types[{i}] {kind!r} is not supported; supported: {', '.join(LAYER_TYPES)}"
             for i, kind in enumerate(types) if kind not in LAYER_TYPES]
    if wrong:
        raise ConfigError(wrong)
    return types


def sliding_window_value(hf_config: Any) -> int | None:
    """The config's ``sliding_window``: a positive whole number of tokens or None; a window
    reaching ``max_position_embeddings`` covers any context and is None (checkpoints such
    as Phi-3-mini-128k carry windows longer than their context)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError([f"sliding_window must be a whole number of tokens >= 1 (or null), got {window!r}"])
    return None if window >= hf_config.max_position_embeddings else window


def layer_windows_of(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's attention window: ``sliding_window`` (``sliding_window_value``) for
    sliding layers, None for full ones."""
    window = sliding_window_value(hf_config)
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types_of(hf_config))


def tied_embeddings(hf_config: Any) -> bool:
    """True when the checkpoint's LM head reuses the embedding matrix."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


@dataclass(frozen=True, slots=True)
class WeightPiece:
    """Rows ``start`` to ``start + len(tensor)`` of parameter ``param`` (its name relative
    to the module that made the piece) come from ``tensor``."""

    param: str
    start: int
    tensor: torch.Tensor


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """This tensor-parallel rank's attention heads: ``heads`` and ``kv_heads`` are the
    global indices it holds (a KV head is replicated among the ranks that share it when
    there are fewer KV heads than ranks), each of ``head_dim`` features."""

    heads: range
    kv_heads: range
    head_dim: int
    total_heads: int
    total_kv_heads: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, head_dim: int, parallel: ModelParallel) -> HeadSplit:
        """The share of ``parallel``'s rank."""
        heads = parallel.split(num_heads)
        first_kv = heads.start * num_kv_heads // num_heads
        return cls(heads, range(first_kv, first_kv + max(1, num_kv_heads // parallel.tp_size)), head_dim,
                   num_heads, num_kv_heads)

    @property
    def q_size(self) -> int:
        """Query features on this rank."""
        return len(self.heads) * self.head_dim

    @property
    def kv_size(self) -> int:
        """Key (and value) features on this rank."""
        return len(self.kv_heads) * self.head_dim

    def rows(self, heads: range) -> slice:
        """The checkpoint rows of ``heads`` in a [heads * head_dim, ...] projection."""
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim)

    def qkv_pieces(self, leaf: str, tensor: torch.Tensor, target: str = "qkv_proj") -> list[WeightPiece] | None:
        """This rank's rows of a q/k/v projection for the fused ``target`` [q | k | v]:
        from separate ``q_proj`` / ``k_proj`` / ``v_proj`` tensors or from one already
        fused as [all q | all k | all v] (Phi-3's ``qkv_proj``); None for other leaves."""
        source, _, suffix = leaf.partition(".")
        param = f"{target}.{suffix}"
        q, kv = self.q_size, self.kv_size
        if source == target:
            total_q = self.total_heads * self.head_dim
            total_kv = self.total_kv_heads * self.head_dim
            parts = tensor.split((total_q, total_kv, total_kv))
            return [WeightPiece(param, 0, parts[0][self.rows(self.heads)]),
                    WeightPiece(param, q, parts[1][self.rows(self.kv_heads)]),
                    WeightPiece(param, q + kv, parts[2][self.rows(self.kv_heads)])]
        starts = {"q_proj": (0, self.heads), "k_proj": (q, self.kv_heads), "v_proj": (q + kv, self.kv_heads)}
        if source not in starts:
            return None
        start, heads = starts[source]
        return [WeightPiece(param, start, tensor[self.rows(heads)])]


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


class DecoderForCausalLM(CausalLM):
    """The shared half of a decoder-only family (see the module docstring). Subclasses
    build their modules, then call ``finish_init``; they implement ``embed`` (first
    stage: token ids to the state carried through the layers), ``final_hidden`` (last
    stage: that state to the LM head's input) and ``decoder_layers``. A layer is called as
    ``layer(*state, positions, kv_cache, meta)`` and returns the next state (a tuple)."""

    LAYER_PREFIX = "model.layers."
    """Where the checkpoint's decoder layers are (followed by the layer's index)."""
    STAGE_WEIGHTS: tuple[str, ...] = ("model.embed_tokens.", "model.norm.", "lm_head.")
    """Prefixes of weights outside the layers that only some pipeline stages hold."""
    ROW_PARALLEL: tuple[str, ...] = ()
    """Linear layers (the last part of their name) whose input columns tensor parallelism splits."""
    COLUMN_PARALLEL: tuple[str, ...] = ()
    """Unfused linear layers whose output rows tensor parallelism splits."""
    VOCAB_WEIGHTS = ("embed_tokens.weight", "word_embeddings.weight", "lm_head.weight")
    """Weights split by vocabulary rows."""

    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__(hf_config, attention, dtype, max_positions, parallel)
        self.hf_config = hf_config
        self.parallel = parallel
        self.vocab_size = hf_config.vocab_size
        self.tie_word_embeddings = tied_embeddings(hf_config)
        self.is_last_stage = parallel.is_last_stage
        self.layer_indices = parallel.layer_range(hf_config.num_hidden_layers)

    def needs_embedding(self) -> bool:
        """True on the stages that hold the token embedding (the first; the last too when tied)."""
        return self.parallel.is_first_stage or (self.tie_word_embeddings and self.parallel.is_last_stage)

    def finish_init(self, head_features: int, embedding: VocabEmbedding | None, dtype: torch.dtype) -> None:
        """Add the LM head (last stage: ``head_features`` in, this rank's vocabulary rows
        out, the embedding's own parameter when tied) and cast to ``dtype``."""
        if self.is_last_stage:
            vocab = self.parallel.padded_split(self.vocab_size)
            self.lm_head = Linear(head_features, len(vocab), bias=False)
            if self.tie_word_embeddings:  # one parameter, named after the embedding; still packed
                self.lm_head.weight = embedding.weight
        self.to(dtype)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """This stage's decoder layers."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """input_ids, positions: [T] -> the first layer's input state."""
        raise NotImplementedError

    def final_hidden(self, state: tuple) -> torch.Tensor:
        """The last layer's output state -> the LM head's input [T, features]."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: Any, carried: tuple[torch.Tensor, ...] | None = None) -> Any:
        """input_ids, positions: [T] -> hidden states on the last stage, else the state the
        next stage carries on with."""
        state = self.embed(input_ids, positions) if carried is None else tuple(carried)
        state = self.run_layers(state, positions, kv_caches, attn_meta)
        return self.final_hidden(state) if self.is_last_stage else state

    def run_layers(self, state: tuple, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: Any) -> tuple:
        """This stage's decoder layers, one after the other, from ``state`` to the state after the last."""
        for layer, kv_cache in zip(self.decoder_layers, kv_caches):
            state = layer(*state, positions, kv_cache, attn_meta)
        return state

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, features] -> float32 logits [N, vocab] (this rank's vocabulary rows,
        gathered from every tensor-parallel rank)."""
        logits = self.lm_head(hidden)
        if logits.dtype != torch.float32:
            logits = logits.float()
        if self.parallel.tp_size > 1:
            logits = self.parallel.all_gather(logits)
        return logits if logits.shape[1] == self.vocab_size else logits[:, :self.vocab_size]

    def warm_up(self, max_tokens: int) -> int:
        """Compile the prepacked CPU matmuls for every row bucket up to ``max_tokens`` and
        pack the quantized layers' weights for their CPU kernels."""
        return warm_up_linears(self, max_tokens) + pack_quantized_linears(self)

    def skips(self, name: str) -> bool:
        """True for checkpoint tensors that have no parameter by design (rotary tables, a
        tied LM head)."""
        return "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors in, keeping this rank's share and this stage's layers
        (fused pieces through their module's ``pieces``); every parameter must be set."""
        params = dict(self.named_parameters())
        pending = {name: 1 for name in params}
        for path, module in self.named_modules():
            for child, count in getattr(module, "fused_counts", dict)().items():
                prefix = f"{path}.{child}."
                for name in params:
                    if name.startswith(prefix):
                        pending[name] = count
        prefix, layers = self.LAYER_PREFIX, self.layer_indices
        with torch.no_grad():
            for name, tensor in weights:
                if self.skips(name):
                    continue
                if name.startswith(prefix):
                    index, _, rest = name[len(prefix):].partition(".")
                    if int(index) not in layers:
                        continue
                    name = f"{prefix}{int(index) - layers.start}.{rest}"
                elif name not in params and name.startswith(self.STAGE_WEIGHTS):
                    continue  # held by another pipeline stage
                self._load_one(params, pending, name, tensor)
        missing = sorted(n for n, count in pending.items() if count > 0)
        if missing:
            raise ConfigError([f"checkpoint is missing weights: {', '.join(missing[:8])}"])

    def _load_one(self, params: dict, pending: dict, name: str, tensor: torch.Tensor) -> None:
        path, leaf = _module_and_leaf(name)
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        pieces = module.pieces(leaf, tensor) if hasattr(module, "pieces") else None
        if pieces is not None:
            for piece in pieces:
                target = f"{path}.{piece.param}"
                params[target][piece.start:piece.start + len(piece.tensor)].copy_(piece.tensor)
                pending[target] -= 1
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
        head (zero rows past the vocabulary); input columns of the row-parallel layers (of
        their 2-D quantized tensors too: int4 bytes and groups hold consecutive input
        features), their biases on rank 0 only (the all-reduce adds them once); output rows
        of the column-parallel ones."""
        parallel = self.parallel
        if parallel.tp_size == 1:
            return tensor
        if name.endswith(self.VOCAB_WEIGHTS):
            vocab = parallel.padded_split(self.vocab_size)
            part = torch.zeros_like(param)
            rows = tensor[vocab.start:min(vocab.stop, self.vocab_size)]
            part[:len(rows)] = rows
            return part
        layer, _, leaf = name.rpartition(".")
        if layer.endswith(self.ROW_PARALLEL):
            if tensor.dim() == 2:
                columns = param.shape[1]
                return tensor[:, parallel.tp_rank * columns:(parallel.tp_rank + 1) * columns]
            if leaf == "bias":
                return tensor if parallel.tp_rank == 0 else torch.zeros_like(tensor)
        if layer.endswith(self.COLUMN_PARALLEL):
            rows = parallel.split(tensor.shape[0])
            return tensor[rows.start:rows.stop]
        return tensor


def _module_and_leaf(name: str) -> tuple[str, str]:
    """``a.b.child.weight`` -> (``a.b``, ``child.weight``)."""
    parts = name.split(".")
    return ".".join(parts[:-2]), ".".join(parts[-2:])
