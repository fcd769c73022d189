"""Top-level config schemas (Hydra structured configs) shared by every servelab app."""

from __future__ import annotations

import importlib.resources
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from servelab.core.deployment import store_deployment_options


@dataclass
class LatentAttentionConfig:
    """Multi-head latent attention (MLA) of a shape, in DeepSeek-V2's config names: each
    token caches a ``kv_lora_rank`` latent and a ``qk_rope_head_dim`` rotary key; heads'
    keys have ``qk_nope_head_dim`` more, values ``v_head_dim``; queries pass a
    ``q_lora_rank`` bottleneck (null: straight from the hidden state)."""

    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: Optional[int] = None


@dataclass
class ExpertsConfig:
    """A mixture-of-experts MLP of a shape, in DeepSeek-V2's config names: the first
    ``first_k_dense_replace`` layers and those in ``mlp_only_layers`` (Qwen-MoE's) are dense
    (``intermediate_size``), the others route each token to ``num_experts_per_tok`` of
    ``n_routed_experts`` experts of ``moe_intermediate_size`` beside ``n_shared_experts`` of
    the same size that every token passes (Mixtral, Qwen3-MoE: 0). ``routing_skew``: the
    exponent of a Zipf-like expert popularity the simulator routes by (0: uniform;
    docs/simulation.md, "Mixture of experts"); ``routing_trace``: instead, the expert
    popularity a real run measured, the ``metrics.json`` of a servelab-bench run of a model
    with as many routed experts (its ``system.experts.pairs_per_expert``). No
    architecture's config has either."""

    n_routed_experts: int = 64
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    moe_intermediate_size: int = 1408
    first_k_dense_replace: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    routing_skew: float = 0.0
    routing_trace: Optional[str] = None


@dataclass
class ModelShapeConfig:
    """A model given by its sizes instead of a checkpoint folder: an ``architecture``
    (``LlamaForCausalLM``, ``MistralForCausalLM``, ``OPTForCausalLM``,
    ``FalconForCausalLM``, ...) of ``num_hidden_layers`` layers of width ``hidden_size``,
    ``num_attention_heads`` query and ``num_key_value_heads`` KV heads (of ``head_dim``,
    default hidden / heads), an MLP of ``intermediate_size`` (the architecture's kind:
    gated for Llama, plain for OPT and Falcon), ``vocab_size`` tokens (default: the
    byte-level tokenizer's 257), ``max_position_embeddings`` positions, an optional
    ``sliding_window`` and ``tie_word_embeddings``. ``window_pattern``: which layers use
    ``sliding_window``, a pattern repeated from the first layer (Gemma-3's ``[true, true,
    true, true, true, false]``: every sixth layer attends to the whole context; empty:
    every layer, when there is a window); ``latent``: latent attention (MLA);
    ``experts``: a mixture-of-experts MLP; ``extra``: other keys of the architecture's
    transformers config, passed as they are (Gemma-3's ``query_pre_attn_scalar``).
    ``random_weights``: build seeded random weights and a byte-level tokenizer in memory
    (``model=toy``); otherwise the model has no weights and no tokenizer, a shape for
    ``executor=simulated`` (``model=llama-2-7b``), and an architecture without a servelab
    implementation is read from these sizes directly (docs/simulation.md).
    """

    architecture: str = "LlamaForCausalLM"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    intermediate_size: int = 128
    vocab_size: Optional[int] = None
    max_position_embeddings: int = 512
    sliding_window: Optional[int] = None
    tie_word_embeddings: bool = False
    window_pattern: list[bool] = field(default_factory=list)
    latent: Optional[LatentAttentionConfig] = None
    experts: Optional[ExpertsConfig] = None
    extra: dict[str, Any] = field(default_factory=dict)
    random_weights: bool = False


@dataclass
class ModelConfig:
    """Which model to serve and how.

    ``path``: a Hugging Face folder (config.json + safetensors + tokenizer). ``shape``: a
    model given by its sizes instead (random weights, or none for simulation).
    ``dtype``: auto | float32 | bfloat16 | float16 (auto = float32 on CPU, the checkpoint's
    dtype on GPU and in simulation). ``max_model_len``: prompt + output limit per sequence
    (default: the model's ``max_position_embeddings``). ``seed``: random weights' seed.
    ``quantization``: auto | none | int8 | w8a8 | int4 | w4a8, the decoder's linear weights
    (auto = as the checkpoint holds them: a folder saved quantized loads quantized, else
    float; w8a8 and w4a8: int8 and int4 weights with activations quantized to int8 per row,
    CPUs with AVX512-VNNI); ``quantization_group_size``: input features per int4 scale
    (default 128, a multiple of 8 for w4a8; a saved int4 folder's own);
    ``quantization_lm_head``: false (default: the head stays float) | true or int8 (every
    mode also multiplies the LM head with int8 weights, quantized at load) | int4 (int4 and
    w4a8: the head in int4 too, in the layers' groups). See docs/quantization.md.
    """

    path: Optional[str] = None
    shape: Optional[ModelShapeConfig] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    quantization: str = "auto"
    quantization_group_size: Optional[int] = None
    quantization_lm_head: Any = False
    max_model_len: Optional[int] = None
    seed: int = 0


@dataclass
class SamplingConfig:
    """Default ``SamplingParams`` for prompts given on the command line: nucleus sampling
    (temperature 0.8, top-p 0.95) with a repetition penalty of 1.1, seeded with 0, so a
    command prints the same completion each time; ``sampling.temperature=0`` is greedy,
    ``sampling.repetition_penalty=1`` turns the penalty off, ``sampling.seed=null`` is
    unseeded."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.1
    max_tokens: int = 64
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1


@dataclass
class LinkConfig:
    """One kind of link a device moves data over to another instance's device:
    ``bandwidth`` bytes/s in one direction, ``latency_s`` the fixed cost of one transfer."""

    bandwidth: float = 1.0e10
    latency_s: float = 1.0e-5


@dataclass
class HardwareConfig:
    """One device of the machine a cost model prices (``hardware=a100-80gb``), from its
    datasheet: ``peak_flops``, dense matmul FLOP/s in the compute dtype (bfloat16/float16
    tensor cores on a GPU); ``memory_bandwidth``, device memory bytes/s; ``memory_bytes``;
    ``interconnect_bandwidth``, bytes/s one device sends another in one direction (NVLink,
    PCIe); ``interconnect_latency_s``, the fixed cost of one collective or send;
    ``host_bandwidth``, bytes/s between device and host memory (swapping);
    ``disk_bandwidth``, bytes/s the node's local storage reads or writes (a lower KV tier,
    ``cache.lower_tier``; default a datacenter NVMe drive's 3 GB/s) and
    ``disk_latency_s``, the fixed cost of a step's batch of reads and writes (100 us);
    ``devices_per_node``; ``memory_utilization``, the share of device memory the engine
    may use (vLLM's ``gpu_memory_utilization``); ``activation_reserve_bytes``, kept per
    device for activations and workspace. ``compute_efficiency`` and
    ``memory_efficiency``: the fractions of peak that the roofline cost model assumes
    kernels reach (calibrated against measured operator times, docs/simulation.md).
    ``interconnect_efficiency``: the fraction of a link's bandwidth a collective or send
    reaches (calibrated against measured all-reduce times); ``network_bandwidth``: bytes/s
    each device sends off its node (its share of the node's InfiniBand/Ethernet), used by
    collectives that span more than ``devices_per_node`` devices and by pipeline sends
    between nodes. ``links``: the links a KV cache can move over between the instances of
    a disaggregated deployment (``nvlink``, ``pcie``, ``infiniband``, ``roce``; a device
    without one leaves it out), chosen by ``deployment.link``."""

    name: str = "local"
    peak_flops: float = 1.0e11
    memory_bandwidth: float = 1.0e10
    memory_bytes: int = 8 << 30
    interconnect_bandwidth: float = 1.0e10
    interconnect_latency_s: float = 1.0e-5
    host_bandwidth: float = 1.0e10
    disk_bandwidth: float = 3.0e9
    disk_latency_s: float = 1.0e-4
    devices_per_node: int = 1
    memory_utilization: float = 0.9
    activation_reserve_bytes: int = 0
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    interconnect_efficiency: float = 0.7
    network_bandwidth: float = 25.0e9
    links: dict[str, LinkConfig] = field(default_factory=dict)


EXPERT_DISPATCH = ("all_reduce", "all_to_all")
"""The values of ``parallel.expert_dispatch``."""


@dataclass
class ParallelConfig:
    """How one engine splits its model over devices: ``tensor_parallel_size`` devices per
    stage (attention heads and MLP columns split, two all-reduces per layer) and
    ``pipeline_parallel_size`` stages of consecutive layers. With ``executor=model`` the
    ranks are processes joined by ``torch.distributed``: ``backend`` auto (NCCL on CUDA,
    gloo on the CPU), gloo or nccl; ``init_method`` spawn (the engine starts its workers
    on this node) or env (``torchrun`` started every rank; docs/parallel.md);
    ``threads``: compute threads per rank, or of an engine on one device (default: this
    machine's cores shared out; restored when the engine is released).
    ``expert_parallel_size``: 1, or as many as ``tensor_parallel_size``: each rank holds
    1/N of a mixture's routed experts whole; ``expert_dispatch``: how real runs bring tokens
    to those experts, ``all_reduce`` (every rank routes every token and runs the pairs of
    its experts; the tensor-parallel all-reduce adds them up) or ``all_to_all`` (each rank
    routes its share of the tokens and sends each pair to the rank holding its expert,
    which sends the result back; the simulator prices this one; docs/parallel.md)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_dispatch: str = "all_reduce"
    backend: str = "auto"
    init_method: str = "spawn"
    threads: Optional[int] = None

    @property
    def num_devices(self) -> int:
        """Devices one engine uses."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def expert_dispatch_problems(parallel: Any) -> list[str]:
    """Why ``parallel.expert_dispatch`` cannot work (empty when it can); ``parallel``: a
    ``ParallelConfig`` or its config node."""
    if parallel.expert_dispatch not in EXPERT_DISPATCH:
        return [f"parallel.expert_dispatch must be one of {', '.join(EXPERT_DISPATCH)}, "
                f"got {parallel.expert_dispatch!r}"]
    if parallel.expert_dispatch == "all_to_all" and parallel.expert_parallel_size == 1:
        return ["parallel.expert_dispatch=all_to_all moves tokens between expert-parallel ranks: it needs "
                "parallel.expert_parallel_size > 1"]
    return []


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (docs/lora.md): on with ``enabled`` or when ``adapters`` names
    any. ``adapters``: name to PEFT adapter folder, loaded at start-up (more load and
    unload at run time); ``max_rank``: the largest rank an adapter may have;
    ``max_adapters``: adapter slots on the device, how many adapters one step can apply
    without splitting its forward pass; ``memory_bytes``: instead, the bytes the slots may
    take (as many slots as fit). More adapters can be registered than there are slots:
    they wait in host memory and are paged into a slot, least recently used out first,
    when a step needs them. ``store``: the adapter store loads read from (a registered
    ``lora_store``: ``local``, the folder each load names; ``directory``, every adapter
    folder under ``store_path`` by name, so an entry of ``adapters`` or a load may give
    only a name). ``admission``: admit a waiting request only
    while the adapters of the requests holding cache fit the slots, preferring requests
    that need no adapter load; the request first in line is overtaken by at most
    ``max_bypass`` others (false: the policy alone admits, and a step that needs more
    adapters than slots runs as several passes). ``unified_pool``: adapters hold pages of
    the KV cache's block pool, one budget for both (S-LoRA; needs cache=paged)."""

    enabled: bool = False
    adapters: Any = None
    max_rank: int = 16
    max_adapters: int = 4
    memory_bytes: Optional[int] = None
    store: str = "local"
    store_path: Optional[str] = None
    admission: bool = True
    max_bypass: int = 64
    unified_pool: bool = False


@dataclass
class EngineConfig:
    """What every servelab app composes to build an ``LLMEngine``: the model, one option
    of each component group (filled from the registry: the four contracts, the
    ``executor`` and, for ``executor=simulated``, the ``cost_model``; the ``router`` that
    spreads requests over replicas; the ``kv_transfer`` connector that moves KV caches
    between instances; the scheduling ``policy`` that orders requests), the ``lora``
    adapters it serves, the service levels
    requests may name (``slo_classes``: name to ``{ttft: seconds, tpot: seconds}``, read
    by ``SLOClass.parse``), the ``hardware`` it is priced
    on, the ``parallel`` split, on ``device``, in a ``role`` (``mixed``; ``prefill`` or
    ``decode`` in a disaggregated deployment, which sets it per pool)."""

    model: ModelConfig = MISSING
    cache: Any = MISSING
    attention: Any = MISSING
    scheduler: Any = MISSING
    decoding: Any = MISSING
    executor: Any = MISSING
    cost_model: Any = MISSING
    router: Any = MISSING
    kv_transfer: Any = MISSING
    policy: Any = MISSING
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    slo_classes: dict[str, Any] = field(default_factory=dict)
    hardware: HardwareConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"
    role: str = "mixed"


@dataclass
class ServelabConfig(EngineConfig):
    """The ``servelab`` app: engine components plus the prompts to complete (``adapter``:
    the name of a ``lora.adapters`` entry they run with; None: the base model)."""

    prompt: Optional[str] = None
    adapter: Optional[str] = None
    prompts: list[str] = field(default_factory=list)
    prompts_file: Optional[str] = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    use_tqdm: bool = True


def checkpoint_path(name: str) -> str:
    """Folder of a checkpoint shipped inside the package (``${servelab_checkpoint:tiny}``)."""
    return str(importlib.resources.files("servelab.checkpoints").joinpath(name))


def register_resolvers() -> None:
    """Register servelab's interpolations (``servelab_checkpoint``); idempotent. Runs when
    this module is imported, so any process that unpickles a servelab config (its schema
    classes live here) can resolve it."""
    if not OmegaConf.has_resolver("servelab_checkpoint"):
        OmegaConf.register_new_resolver("servelab_checkpoint", checkpoint_path)


def resolved(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with every interpolation resolved, structured types kept: what
    crosses into another process (the server's engine, a worker, a launcher's job), so
    the receiver needs no resolver and reads the values the sender saw (environment
    variables included)."""
    copy = deepcopy(cfg)
    OmegaConf.resolve(copy)
    return copy


def store_schemas() -> None:
    """Register the schemas and servelab's resolvers (idempotent)."""
    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="servelab_schema", node=ServelabConfig)
    store_deployment_options()


register_resolvers()
