"""A model given by its sizes (``model.shape``, a ``ModelShapeConfig``): the transformers
config of its architecture, and the ``ModelShape`` read from the sizes themselves for an
architecture servelab has no implementation of, or whose implementation does not describe
its mixture of experts (a weightless preset that only ``executor=simulated`` runs,
docs/simulation.md)."""

from __future__ import annotations

import json
import re

from dataclasses import asdict, replace
from typing import Any

from omegaconf import OmegaConf

from servelab.core.errors import ConfigError
from servelab.core.model import LatentAttention, MixtureOfExperts, ModelShape


def layer_windows_of(shape: Any) -> tuple[int | None, ...]:
    """Each layer's window: ``sliding_window`` on the layers ``window_pattern`` (repeated
    over the layers; empty: every layer) marks, None on the others and on every layer when
    there is no window or it spans every position."""
    pattern = list(shape.window_pattern) or [True]
    window = shape.sliding_window
    if window is not None and window >= shape.max_position_embeddings:
        window = None
    return tuple(window if pattern[layer % len(pattern)] else None for layer in range(shape.num_hidden_layers))


def head_dim_of(shape: Any) -> int:
    """The query-key head size: a latent attention's nope + rope, else ``head_dim`` or
    hidden / heads."""
    if shape.latent is not None:
        return shape.latent.qk_nope_head_dim + shape.latent.qk_rope_head_dim
    return shape.head_dim or shape.hidden_size // shape.num_attention_heads


def sizes_problems(shape: Any) -> list[str]:
    """What is inconsistent among a shape's sizes, each naming its ``model.shape`` field."""
    problems = []
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "max_position_embeddings"):
        if getattr(shape, field) < 1:
            problems.append(f"model.shape.{field} must be >= 1, got {getattr(shape, field)}")
    if shape.window_pattern and shape.sliding_window is None:
        problems.append("model.shape.window_pattern needs model.shape.sliding_window (the window of the "
                        "pattern's true layers)")
    latent = shape.latent
    if latent is not None:
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(latent, field) < 1:
                problems.append(f"model.shape.latent.{field} must be >= 1, got {getattr(latent, field)}")
        if latent.q_lora_rank is not None and latent.q_lora_rank < 1:
            problems.append(f"model.shape.latent.q_lora_rank must be >= 1 or null, got {latent.q_lora_rank}")
        if shape.head_dim is not None and shape.head_dim != head_dim_of(shape):
            problems.append(f"model.shape.head_dim={shape.head_dim} disagrees with model.shape.latent: a latent "
                            f"attention's query-key head is qk_nope_head_dim + qk_rope_head_dim = {head_dim_of(shape)}")
    experts = shape.experts
    if experts is not None:
        if not 1 <= experts.num_experts_per_tok <= experts.n_routed_experts:
            problems.append(f"model.shape.experts.num_experts_per_tok must be in [1, n_routed_experts="
                            f"{experts.n_routed_experts}], got {experts.num_experts_per_tok}")
        if not 0 <= experts.first_k_dense_replace < shape.num_hidden_layers:
            problems.append(f"model.shape.experts.first_k_dense_replace must be in [0, num_hidden_layers), got "
                            f"{experts.first_k_dense_replace}")
        if experts.n_shared_experts < 0 or experts.moe_intermediate_size < 1:
            problems.append(f"model.shape.experts.n_shared_experts must be >= 0 and moe_intermediate_size >= 1, got "
                            f"{experts.n_shared_experts} and {experts.moe_intermediate_size}")
        outside = [layer for layer in experts.mlp_only_layers if not 0 <= layer < shape.num_hidden_layers]
        if outside:
            problems.append(f"model.shape.experts.mlp_only_layers: {outside} are not layers of the model's "
                            f"{shape.num_hidden_layers}")
        if experts.routing_skew < 0:
            problems.append(f"model.shape.experts.routing_skew must be >= 0, got {experts.routing_skew}")
        if getattr(experts, "routing_trace", None) is not None:
            problems += trace_problems(experts)
    return problems


def model_shape_of(shape: Any, vocab_size: int) -> ModelShape:
    """The ``ModelShape`` of a ``ModelShapeConfig`` read from its sizes: a gated MLP;
    per-layer windows from ``window_pattern``; a latent attention; a mixture of experts
    (``priced_experts``)."""
    problems = sizes_problems(shape)
    if problems:
        raise ConfigError(problems)
    latent = None if shape.latent is None else LatentAttention(
        shape.latent.kv_lora_rank, shape.latent.qk_nope_head_dim, shape.latent.qk_rope_head_dim,
        shape.latent.v_head_dim, shape.latent.q_lora_rank)
    model = ModelShape(shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads,
                       head_dim_of(shape), shape.sliding_window, shape.max_position_embeddings, vocab_size,
                       shape.hidden_size, shape.intermediate_size, shape.tie_word_embeddings,
                       layer_windows=layer_windows_of(shape) if shape.window_pattern else (), latent=latent)
    return model if shape.experts is None else priced_experts(model, shape.experts)


def priced_experts(model: ModelShape, experts: Any) -> ModelShape:
    """``model`` (whose ``intermediate_size`` is its dense layers' MLP) with the mixture of
    experts ``experts`` gives in DeepSeek's names (``n_routed_experts``,
    ``num_experts_per_tok``, ``n_shared_experts``, ``moe_intermediate_size``,
    ``first_k_dense_replace``; a ``model.shape.experts``, which may add
    ``mlp_only_layers`` and ``routing_skew``, or a DeepSeek config), which the cost model
    prices expert by expert (docs/simulation.md, "Mixture of experts")."""
    dense = set(range(min(experts.first_k_dense_replace, model.num_layers)))
    dense.update(getattr(experts, "mlp_only_layers", None) or ())
    return simulated_routing(replace(model, experts=MixtureOfExperts(
        experts.n_routed_experts, experts.num_experts_per_tok, experts.moe_intermediate_size,
        experts.n_shared_experts * experts.moe_intermediate_size, tuple(sorted(dense)))), experts)


def simulated_routing(model: ModelShape, experts: Any) -> ModelShape:
    """``model`` whose mixture of experts routes as ``experts`` (a ``model.shape.experts``,
    or an architecture's config, which has neither) says the simulator should:
    ``routing_skew``, or the popularity of a ``routing_trace``."""
    skew, trace = float(getattr(experts, "routing_skew", 0.0)), getattr(experts, "routing_trace", None)
    popularity = trace_popularity(trace) if trace is not None else ()
    return replace(model, experts=replace(model.experts, routing_skew=skew, popularity=popularity))


def _trace_pairs(path: str) -> list:
    """``system.experts.pairs_per_expert`` of a servelab-bench ``metrics.json``; a
    ``ConfigError`` naming ``model.shape.experts.routing_trace`` when it has none."""
    try:
        with open(path) as f:
            pairs = json.load(f)["system"]["experts"]["pairs_per_expert"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError([f"model.shape.experts.routing_trace={path!r}: no servelab-bench metrics.json with "
                           f"system.experts.pairs_per_expert ({type(exc).__name__}: {exc})"]) from exc
    return pairs


def trace_problems(experts: Any) -> list[str]:
    """What keeps ``experts.routing_trace`` from giving the experts' popularity: no
    readable trace, another expert count, no pairs, and a ``routing_skew`` beside it."""
    path = experts.routing_trace
    try:
        pairs = _trace_pairs(path)
    except ConfigError as exc:
        return list(exc.problems)
    problems = []
    if len(pairs) != experts.n_routed_experts:
        problems.append(f"model.shape.experts.routing_trace={path!r} counts {len(pairs)} experts, the shape "
                        f"routes to n_routed_experts={experts.n_routed_experts}")
    elif min(pairs) < 0 or sum(pairs) <= 0:
        problems.append(f"model.shape.experts.routing_trace={path!r} holds no routed pairs")
    if experts.routing_skew:
        problems.append(f"model.shape.experts.routing_skew={experts.routing_skew} and routing_trace both set the "
                        f"experts' popularity: set one")
    return problems


def trace_popularity(path: str) -> tuple[float, ...]:
    """Each expert's share of the pairs a real run routed (``trace_problems`` checked it)."""
    pairs = _trace_pairs(path)
    total = sum(pairs)
    return tuple(count / total for count in pairs)


def expert_sizes(model_type: str, shape: Any) -> tuple[dict[str, Any], list[str]]:
    """A shape's ``experts`` in the transformers config names of ``model_type`` (Mixtral's
    ``num_local_experts``, Qwen-MoE's ``num_experts`` and ``mlp_only_layers``, else
    DeepSeek's), and what that architecture cannot take, each naming its field."""
    experts = shape.experts
    dense = sorted(set(range(experts.first_k_dense_replace)) | set(experts.mlp_only_layers))
    shared = experts.n_shared_experts * experts.moe_intermediate_size
    common = {"num_experts_per_tok": experts.num_experts_per_tok}
    problems = []
    if model_type == "mixtral":
        if dense or shared:
            problems.append(f"model.shape.experts: MixtralForCausalLM has neither dense layers nor shared experts "
                            f"(first_k_dense_replace={experts.first_k_dense_replace}, mlp_only_layers="
                            f"{list(experts.mlp_only_layers)}, n_shared_experts={experts.n_shared_experts})")
        return {**common, "num_local_experts": experts.n_routed_experts,
                "intermediate_size": experts.moe_intermediate_size}, problems
    if model_type in ("qwen2_moe", "qwen3_moe"):
        sizes = {**common, "num_experts": experts.n_routed_experts,
                 "moe_intermediate_size": experts.moe_intermediate_size, "mlp_only_layers": dense,
                 "decoder_sparse_step": 1, "norm_topk_prob": model_type == "qwen3_moe"}
        if model_type == "qwen2_moe":
            sizes["shared_expert_intermediate_size"] = shared
        elif shared:
            problems.append(f"model.shape.experts.n_shared_experts={experts.n_shared_experts}: Qwen3MoeForCausalLM "
                            f"has no shared experts")
        return sizes, problems
    if experts.mlp_only_layers:
        problems.append(f"model.shape.experts.mlp_only_layers={list(experts.mlp_only_layers)}: "
                        f"{shape.architecture}'s config has dense layers only first (first_k_dense_replace)")
    return {**common, "n_routed_experts": experts.n_routed_experts, "n_shared_experts": experts.n_shared_experts,
            "moe_intermediate_size": experts.moe_intermediate_size,
            "first_k_dense_replace": experts.first_k_dense_replace}, problems


def _opt_sizes(shape: Any, sizes: dict[str, Any]) -> list[str]:
    """OPT's names: ``ffn_dim``, ``word_embed_proj_dim``; multi-head attention of hidden / heads."""
    sizes["ffn_dim"] = sizes.pop("intermediate_size")
    sizes["word_embed_proj_dim"] = shape.hidden_size
    heads = sizes.pop("num_key_value_heads")
    problems = _whole_heads("OPTForCausalLM", shape, sizes)
    if heads != shape.num_attention_heads:
        problems.append(f"model.shape.num_key_value_heads={heads}: OPTForCausalLM has as many KV heads as "
                        f"attention heads ({shape.num_attention_heads})")
    return problems


def _falcon_sizes(shape: Any, sizes: dict[str, Any]) -> list[str]:
    """Falcon's names: ``ffn_hidden_size``; the KV layout from the KV heads (as many as
    heads: multi-head; one: multi-query, Falcon-7B; else the new decoder architecture
    with ``num_kv_heads``, Falcon-40B/180B)."""
    sizes["ffn_hidden_size"] = sizes.pop("intermediate_size")
    kv_heads = sizes.pop("num_key_value_heads")
    sizes.update(new_decoder_architecture=kv_heads not in (1, shape.num_attention_heads), multi_query=kv_heads == 1,
                 num_kv_heads=kv_heads)
    return _whole_heads("FalconForCausalLM", shape, sizes)


def _whole_heads(architecture: str, shape: Any, sizes: dict[str, Any]) -> list[str]:
    """Problems of sizes an architecture with heads of hidden / heads and no window cannot take."""
    problems = []
    hidden, heads, head_dim = shape.hidden_size, shape.num_attention_heads, sizes.pop("head_dim", None)
    if hidden % heads or head_dim not in (None, hidden // heads):
        problems.append(f"model.shape.head_dim={head_dim}: {architecture}'s heads are hidden_size / "
                        f"num_attention_heads ({hidden} / {heads}) wide, a whole number")
    if shape.sliding_window is not None:
        problems.append(f"model.shape.sliding_window={shape.sliding_window}: {architecture} has no sliding window")
    return problems


FAMILY_SIZES = {"opt": _opt_sizes, "falcon": _falcon_sizes}
"""Per transformers model type, how its config names the common sizes (the others take
Llama's names), and what it cannot take."""


def model_type_of(architecture: str) -> str | None:
    """transformers' model type of a causal-LM ``architecture`` (None: not one): of the
    model types that use the class, the one whose config class carries its name
    (``deepseek_v3`` for ``DeepseekV3ForCausalLM``, not another family built on it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    candidates = [model_type for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture]
    stem = re.sub(r"(ForCausalLM|LMHeadModel)$", "", architecture)
    named = [model_type for model_type in candidates if CONFIG_MAPPING_NAMES.get(model_type) == f"{stem}Config"]
    return (named or candidates or [None])[-1]


def shape_config(shape: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """The transformers config of a ``ModelShapeConfig``'s architecture with its sizes, in
    that architecture's names (OPT's ``ffn_dim``, Falcon's ``ffn_hidden_size`` and KV
    layout; each layer's ``layer_types`` from ``window_pattern``; MLA in DeepSeek's names,
    experts in the architecture's, ``expert_sizes``); raises ``ConfigError`` naming every inconsistent field."""
    from transformers import AutoConfig

    model_type = model_type_of(shape.architecture)
    if model_type is None:
        raise ConfigError([f"model.shape.architecture={shape.architecture!r} is no transformers causal LM "
                           f"(e.g. LlamaForCausalLM, MistralForCausalLM, OPTForCausalLM, FalconForCausalLM)"])
    sizes = {key: getattr(shape, key) for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "max_position_embeddings", "tie_word_embeddings")}
    if shape.head_dim is not None:
        sizes["head_dim"] = shape.head_dim
    sizes["sliding_window"] = shape.sliding_window  # also null: an architecture's default window is not the shape's
    if shape.sliding_window is not None:
        sizes["use_sliding_window"] = True
    if shape.window_pattern:
        sizes["layer_types"] = ["full_attention" if window is None else "sliding_attention"
                                for window in layer_windows_of(shape)]
    if shape.latent is not None:
        latent = shape.latent
        sizes.update(OmegaConf.to_container(latent) if OmegaConf.is_config(latent) else asdict(latent))
    problems = sizes_problems(shape)
    if shape.experts is not None and not problems:
        experts, problems = expert_sizes(model_type, shape)
        sizes.update(experts)
    if model_type in FAMILY_SIZES:
        problems += FAMILY_SIZES[model_type](shape, sizes)
    if problems:
        raise ConfigError(problems)
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, bos_token_id=eos_token_id,
                                eos_token_id=eos_token_id, architectures=[shape.architecture],
                                **{**sizes, **shape.extra})
