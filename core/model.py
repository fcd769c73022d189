"""The model contract: a causal LM that runs on flat token batches."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from servelab.core.attention import AttentionSpec
from servelab.core.kv_cache import KVCacheSpec


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2's MLA): every token caches one latent of
    ``kv_lora_rank`` and one rotary key of ``qk_rope_head_dim`` that all heads share; each
    head's key (``qk_nope_head_dim`` + ``qk_rope_head_dim``) and value (``v_head_dim``) come
    out of the latent through ``kv_b_proj``. Queries pass a ``q_lora_rank`` bottleneck, or
    come straight from the hidden state (None)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def cached_width(self) -> int:
        """Elements one token caches per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def linear_shapes(self, hidden: int, heads: int) -> dict[str, tuple[int, int]]:
        """(output, input) features of the attention's linear layers (Hugging Face names)
        for ``heads`` query heads; the latent's down projection is whole on every rank."""
        q_width = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank is None:
            query = {"self_attn.q_proj": (q_width, hidden)}
        else:
            query = {"self_attn.q_a_proj": (self.q_lora_rank, hidden),
                     "self_attn.q_b_proj": (q_width, self.q_lora_rank)}
        return {**query, "self_attn.kv_a_proj_with_mqa": (self.cached_width, hidden),
                "self_attn.kv_b_proj": (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                "self_attn.o_proj": (hidden, heads * self.v_head_dim)}


@dataclass(frozen=True, slots=True)
class MixtureOfExperts:
    """A mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek): a router [``num_experts``,
    hidden] sends each token to ``top_k`` of ``num_experts`` gated experts of
    ``expert_intermediate_size``; shared experts, ``shared_intermediate_size`` wide together
    (0: none; DeepSeek's ``n_shared_experts`` x ``moe_intermediate_size``), pass every token;
    the layers in ``dense_layers`` have the model's dense MLP instead (DeepSeek's first
    ``first_k_dense_replace``, Qwen's ``mlp_only_layers``). ``routing_skew``: how unevenly
    tokens pick experts, the exponent s of a Zipf-like popularity in which expert e (from 0)
    weighs (e + 1) ** -s (0: uniform; see ``plugins/cost_model/experts.py``).
    ``shared_gate``: the shared experts' output is scaled by a sigmoid gate [1, hidden]
    (Qwen2-MoE's ``shared_expert_gate``). ``popularity``: each expert's share of the pairs
    routed (a real run's, ``model.shape.experts.routing_trace``), which then replaces the
    skew's (empty: the skew's)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    routing_skew: float = 0.0
    shared_gate: bool = False
    popularity: tuple[float, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """True when decoder layer ``layer`` has the mixture (not a dense MLP)."""
        return layer not in self.dense_layers

    def sparse_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` decoder layers have the mixture."""
        return sum(map(self.is_sparse, range(num_layers)))

    def linear_shapes(self, hidden: int) -> tuple[tuple[int, int], ...]:
        """(output, input) features of one sparse layer's MLP matrices: the router, each
        routed expert's gate, up and down, and the shared experts' (as one of their width)
        with their gate."""
        width, shared = self.expert_intermediate_size, self.shared_intermediate_size
        expert = ((width, hidden), (width, hidden), (hidden, width))
        return ((self.num_experts, hidden), *expert * self.num_experts,
                *(((shared, hidden), (shared, hidden), (hidden, shared)) if shared else ()),
                *(((1, hidden),) if self.shared_gate else ()))

    def parameters(self, hidden: int) -> int:
        """Weights of one sparse layer's MLP (``linear_shapes``)."""
        return sum(outputs * inputs for outputs, inputs in self.linear_shapes(hidden))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes the engine (and a cost model) needs before building a model: ``num_layers``
    decoder layers, each with attention of ``num_heads`` query and ``num_kv_heads`` KV heads
    of ``head_dim`` and an MLP of ``intermediate_size`` over ``hidden_size``: ``mlp_kind``
    "gated" (gate, up and down matrices: SwiGLU) or "plain" (up and down: OPT's fc1/fc2,
    Falcon's dense_h_to_4h/dense_4h_to_h); ``sliding_window`` (None = full attention), the
    window of every layer unless ``layer_windows`` gives one per layer (None: that layer
    attends to the whole context; Gemma interleaves windowed and global layers);
    ``max_positions`` and ``vocab_size``; ``tied_embeddings`` when the LM head reuses the
    embedding matrix; ``attention_scale``, the softmax scale (None: ``head_dim ** -0.5``),
    and ``attention_softcap``, the attention scores' soft cap (None: none), both model-wide
    and passed on in ``attention_spec``; ``latent``: the layers' attention is latent (MLA;
    ``head_dim`` is then the query-key width, nope + rope); ``experts``: a mixture of
    experts in the layers it marks sparse (``intermediate_size`` is then the dense layers'
    MLP)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    max_positions: int
    vocab_size: int
    hidden_size: int = 0
    intermediate_size: int = 0
    tied_embeddings: bool = False
    mlp_kind: str = "gated"
    layer_windows: tuple[int | None, ...] = ()
    attention_scale: float | None = None
    attention_softcap: float | None = None
    latent: LatentAttention | None = None
    experts: MixtureOfExperts | None = None

    def window_of(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` (None: the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: 3 when gated, 2 when plain."""
        return 3 if self.mlp_kind == "gated" else 2

    @property
    def layer_parameters(self) -> int:
        """Weights of one decoder layer with a dense MLP: its linear layers
        (``linear_shapes``), the two norms and a latent attention's norms (biases are not
        counted)."""
        norms = 2 * self.hidden_size
        if self.latent is not None:
            norms += self.latent.kv_lora_rank + (self.latent.q_lora_rank or 0)
        return sum(outputs * inputs for outputs, inputs in self.linear_shapes().values()) + norms

    @property
    def num_parameters(self) -> int:
        """Every weight: the layers (a sparse layer's whole mixture of experts in place of
        the dense MLP), the embedding, the final norm and the LM head (once when tied)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tied_embeddings else embedding
        sparse = 0
        if self.experts is not None:
            layers = self.experts.sparse_layers(self.num_layers)
            dense_mlp = self.mlp_matrices * self.hidden_size * self.intermediate_size
            sparse = layers * (self.experts.parameters(self.hidden_size) - dense_mlp)
        return self.num_layers * self.layer_parameters + sparse + embedding + head + self.hidden_size

    def linear_shapes(self, tensor_parallel_size: int = 1) -> dict[str, tuple[int, int]]:
        """(output, input) features of each decoder layer's linear layers (Hugging Face
        names) on one of ``tensor_parallel_size`` ranks: the q, k, v, gate (gated MLPs
        only) and up projections split their outputs, the output and down projections
        their inputs (a latent attention's: ``LatentAttention.linear_shapes``)."""
        hidden, tp = self.hidden_size, tensor_parallel_size
        q_width, kv_width = self.num_heads * self.head_dim // tp, self.kv_heads_per_rank(tp) * self.head_dim
        mlp = self.intermediate_size // tp
        if self.latent is not None:
            attention = self.latent.linear_shapes(hidden, self.num_heads // tp)
        else:
            attention = {"self_attn.q_proj": (q_width, hidden), "self_attn.k_proj": (kv_width, hidden),
                         "self_attn.v_proj": (kv_width, hidden), "self_attn.o_proj": (hidden, q_width)}
        shapes = {**attention, "mlp.gate_proj": (mlp, hidden), "mlp.up_proj": (mlp, hidden),
                  "mlp.down_proj": (hidden, mlp)}
        if self.mlp_kind != "gated":
            del shapes["mlp.gate_proj"]
        return shapes

    def linear_in_features(self, tensor_parallel_size: int = 1) -> dict[str, int]:
        """Input features of each decoder layer's linear layers on one of
        ``tensor_parallel_size`` ranks (``linear_shapes``)."""
        return {name: inputs for name, (_, inputs) in self.linear_shapes(tensor_parallel_size).items()}

    def attention_windows(self, max_model_len: int) -> tuple[int | None, ...]:
        """Each layer's attention window for sequences of up to ``max_model_len`` tokens
        (a window as long as the context is no window)."""
        return tuple(window if window and window < max_model_len else None
                     for window in map(self.window_of, range(self.num_layers)))

    def attention_spec(self, dtype: torch.dtype, device: torch.device, max_model_len: int,
                       tensor_parallel_size: int = 1, kv_dtype: torch.dtype | None = None,
                       layer: int | None = None) -> AttentionSpec:
        """The attention backend's spec on one of ``tensor_parallel_size`` ranks for decoder
        layer ``layer`` (None: with the model's ``sliding_window``; a window as long as the
        context is no window); ``kv_dtype``: the cache's element type (None: ``dtype``). A
        latent attention runs absorbed, as multi-query attention over one KV head of
        ``cached_width`` whose values are its keys (the latent and rotary key; the model
        keeps the latent part of the output)."""
        window = self.sliding_window if layer is None else self.window_of(layer)
        window = window if window and window < max_model_len else None
        scale = self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale
        head_dim = self.head_dim if self.latent is None else self.latent.cached_width
        return AttentionSpec(self.num_heads // tensor_parallel_size, self.kv_heads_per_rank(tensor_parallel_size),
                             head_dim, scale, dtype, device, window,
                             None if kv_dtype == dtype else kv_dtype, self.attention_softcap,
                             values_are_keys=self.latent is not None)

    def kv_cache_spec(self, dtype: torch.dtype, max_model_len: int, tensor_parallel_size: int = 1,
                      pipeline_parallel_size: int = 1) -> KVCacheSpec:
        """What one device's KV cache stores per token in element type ``dtype``: the layers
        of the largest pipeline stage and the KV heads of one tensor-parallel rank (see
        ``kv_heads_per_rank``), with each layer's window (``attention_windows``; under
        pipeline parallelism only when every layer shares it). A latent attention stores its
        ``cached_width`` elements once, whole on every rank, as one KV head whose values
        are its keys (``attention_spec``)."""
        layers = -(-self.num_layers // pipeline_parallel_size)
        windows = self.attention_windows(max_model_len)
        if pipeline_parallel_size > 1 and len(set(windows)) > 1:
            windows = ()  # stages would group their layers differently; one group keeps every token
        else:
            windows = windows[:layers]
        if self.latent is not None:
            return KVCacheSpec(layers, 1, self.latent.cached_width, dtype, max_model_len, windows, values_are_keys=True)
        return KVCacheSpec(layers, self.kv_heads_per_rank(tensor_parallel_size), self.head_dim, dtype, max_model_len,
                           windows)

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads each of ``tensor_parallel_size`` ranks holds: an equal share, or one
        (replicated) when there are fewer KV heads than ranks; a latent attention's one
        latent head on every rank."""
        if self.latent is not None:
            return 1
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def parallel_problems(self, tensor_parallel_size: int, pipeline_parallel_size: int,
                          expert_parallel_size: int = 1) -> list[str]:
        """Why this model cannot be split this way (empty when it can): query heads and
        the MLP must divide among tensor-parallel ranks, KV heads must divide among them
        or they among the KV heads (a latent attention's one latent head is on every
        rank), and every pipeline stage needs a layer; ``expert_parallel_size`` must
        divide the routed experts and be 1 or the tensor-parallel ranks (which then hold
        whole experts; else they split every expert's width)."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        problems = self._expert_problems(tp, expert_parallel_size)
        if tp < 1 or pp < 1:
            problems.append(f"parallel.tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
            return problems
        if self.num_heads % tp:
            problems.append(f"parallel.tensor_parallel_size={tp} does not divide the model's {self.num_heads} "
                            f"attention heads")
        if self.latent is None and self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"parallel.tensor_parallel_size={tp} and the model's {self.num_kv_heads} KV heads: "
                            f"neither divides the other, so the KV heads can be neither split nor replicated")
        dense_mlp = self.experts is None or self.experts.sparse_layers(self.num_layers) < self.num_layers
        if dense_mlp and self.intermediate_size and self.intermediate_size % tp:
            problems.append(f"parallel.tensor_parallel_size={tp} does not divide the MLP's intermediate size "
                            f"{self.intermediate_size}")
        if pp > self.num_layers:
            problems.append(f"parallel.pipeline_parallel_size={pp} exceeds the model's {self.num_layers} layers")
        return problems

    def _expert_problems(self, tp: int, ep: int) -> list[str]:
        """``parallel_problems``' checks of the expert-parallel split and the experts' widths."""
        if ep == 1 and self.experts is None:
            return []
        if self.experts is None:
            return [f"parallel.expert_parallel_size={ep}: the model's shape describes no mixture of experts "
                    f"(must be 1)"]
        experts, problems = self.experts, []
        if ep < 1 or experts.num_experts % ep or ep not in (1, tp):
            problems.append(f"parallel.expert_parallel_size={ep} must divide the model's {experts.num_experts} "
                            f"routed experts and be 1 or parallel.tensor_parallel_size={tp}")
        split = tp if ep == 1 else 1  # ranks that share each expert's width
        for name, width in (("routed", experts.expert_intermediate_size), ("shared", experts.shared_intermediate_size)):
            if split >= 1 and width % split:
                problems.append(f"parallel.tensor_parallel_size={tp} does not divide the {name} experts' "
                                f"intermediate size {width}")
        return problems


@dataclass(frozen=True, slots=True)
class ModelParallel:
    """Where one model instance sits in a tensor x pipeline split.

    ``tp_rank`` of ``tp_size`` ranks that split every layer of its stage Megatron-style
    (``tp_group``: their ``torch.distributed`` group, None alone); ``pp_rank`` of
    ``pp_size`` pipeline stages, each holding consecutive layers. Alone, the collectives
    are no-ops. ``expert_parallel``: the tensor-parallel ranks hold a mixture's routed
    experts whole, 1/``tp_size`` of them each (``expert_range``), instead of a share of
    every expert's width (``parallel.expert_parallel_size``); ``expert_dispatch``
    ``all_to_all``: each rank routes its ``token_rows`` and moves the pairs to their experts'
    ranks and back (``all_to_all``) instead of routing every token.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None
    expert_parallel: bool = False
    expert_dispatch: str = "all_reduce"

    @property
    def dispatches_tokens(self) -> bool:
        """True when a mixture's pairs travel to their experts' ranks by all-to-all."""
        return self.expert_parallel and self.tp_size > 1 and self.expert_dispatch == "all_to_all"

    def token_rows(self, num_tokens: int) -> slice:
        """This rank's share of a step's ``num_tokens`` rows under ``all_to_all`` dispatch:
        consecutive, ceil(num_tokens / ``tp_size``) each (the last ranks' may be short or empty)."""
        share = -(-num_tokens // self.tp_size)
        return slice(min(self.tp_rank * share, num_tokens), min((self.tp_rank + 1) * share, num_tokens))

    def expert_range(self, num_experts: int) -> range:
        """The routed experts this rank holds: its share under expert parallelism, else all."""
        return self.split(num_experts) if self.expert_parallel else range(num_experts)

    @property
    def is_first_stage(self) -> bool:
        """True on the stage that embeds the tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the stage with the final norm and the LM head."""
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """This stage's layers: consecutive, as even as possible, earlier stages taking one
        more when they do not divide."""
        per, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * per + min(self.pp_rank, extra)
        return range(start, start + per + (self.pp_rank < extra))

    def split(self, size: int) -> range:
        """This rank's share of ``size`` rows split evenly (``size`` divides by ``tp_size``)."""
        share = size // self.tp_size
        return range(self.tp_rank * share, (self.tp_rank + 1) * share)

    def padded_split(self, size: int) -> range:
        """This rank's share of ``size`` rows in chunks of ceil(size / ``tp_size``) (the last
        rank's may run past ``size``: a vocabulary that does not divide)."""
        share = -(-size // self.tp_size)
        return range(self.tp_rank * share, (self.tp_rank + 1) * share)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the stage's tensor-parallel ranks (in place)."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` sent to the ranks in order, ``send_counts[r]`` to rank r; returns the
        rows received, ``receive_counts[r]`` from rank r, in rank order."""
        import torch.distributed as dist

        out = torch.empty((sum(receive_counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), receive_counts, send_counts, group=self.tp_group)
        return out


class CausalLM(nn.Module, abc.ABC):
    """A decoder-only language model over a flat batch of new tokens.

    Implementations are registered under the architecture names of ``config.json``
    (``LlamaForCausalLM``, ...) and built as ``cls(hf_config, attention, dtype,
    max_positions, parallel)``: ``parallel`` (a ``ModelParallel``) says which share of the
    heads, MLP columns, vocabulary and layers this instance holds. Each attention layer
    calls ``attention.forward(q, k, v, kv_caches[layer], attn_meta, layer)`` with its
    index among this instance's layers.
    """

    CARRIED_TENSORS = 2
    """How many [T, hidden] tensors a pipeline stage passes to the next (``forward``'s
    ``carried``): 2 for an (output, residual) pair, 1 for a plain hidden state."""

    @classmethod
    @abc.abstractmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """The model's sizes, read from its Hugging Face config."""

    @abc.abstractmethod
    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int,
                 parallel: ModelParallel = ModelParallel()):
        super().__init__()

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, keeping this
        instance's share of each."""

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: Any, carried: tuple[torch.Tensor, ...] | None = None) -> Any:
        """input_ids, positions: [T]. The first pipeline stage reads ``input_ids``, a later
        one ``carried`` (what the stage before returned); every stage but the last
        returns the tensors to send on (a tuple), the last the final hidden states
        [T, hidden]."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32 (on the last stage; every
        tensor-parallel rank takes part and gets the whole vocabulary)."""

    def hidden_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                          attn_meta: Any, logits_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole step on a single stage: ``forward``'s hidden states [T, hidden] and
        ``compute_logits`` of its rows ``logits_rows`` (None: every row). A model may run
        both at once; by default it calls the two."""
        hidden = self(input_ids, positions, kv_caches, attn_meta)
        return hidden, self.compute_logits(hidden if logits_rows is None else hidden[logits_rows])

    def greedy_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                     attn_meta: Any, steps: int) -> torch.Tensor | None:
        """``steps`` greedy decode steps of a decode batch (one token a request) in one go,
        each row's argmax fed back as its next token into the slots its block table
        reserves (multi-step decoding): the tokens [steps, T], with ``input_ids``,
        ``positions`` and the layout's slots and sequence lengths advanced in place; None
        where the model cannot (the executor then runs the steps one by one). None by
        default."""
        return None

    def warm_up(self, max_tokens: int) -> int:
        """Prepare whatever kernels steps of up to ``max_tokens`` tokens will need (compiled
        on first use otherwise); returns how many were prepared. Nothing by default."""
        return 0
