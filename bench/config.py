"""Config schemas of ``servelab-bench``: the engine's groups plus workload, target,
baseline, mode and SLOs.

``workload`` presets are YAML files merged into ``WorkloadConfig`` (like model presets);
``target``, ``baseline`` and ``mode`` options are the dataclasses below, stored in Hydra's
ConfigStore, and the harness picks the implementation by the node's dataclass type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from servelab.core.config import EngineConfig


@dataclass
class ShareGPTLengths:
    """Lognormal prompt and output lengths whose means match ShareGPT (docs/bench.md):
    ``input_mean`` and ``output_mean`` tokens, log-space standard deviation ``sigma``."""

    input_mean: float = 161.31
    output_mean: float = 337.99
    sigma: float = 1.0


@dataclass
class TenantConfig:
    """One tenant of a multi-tenant workload (``workload.tenants.<name>``): its requests
    arrive at ``rate`` requests/s (required, > 0) by ``arrival`` (with ``burstiness``);
    ``num_requests`` of them (null: its share of ``workload.num_requests`` by rate);
    prompt and output lengths by ``lengths`` with ``input_len``/``output_len`` or
    ``input_range``/``output_range``. Null fields take the workload's value. Each request
    carries ``RequestMetadata(tenant=<name>, priority, slo_class)``."""

    rate: Optional[float] = None
    num_requests: Optional[int] = None
    arrival: Optional[str] = None
    burstiness: Optional[float] = None
    lengths: Optional[str] = None
    input_len: Optional[int] = None
    output_len: Optional[int] = None
    input_range: Optional[list[int]] = None
    output_range: Optional[list[int]] = None
    priority: int = 0
    slo_class: Optional[str] = None


@dataclass
class MultiTurnConfig:
    """``workload.multi_turn``: ``conversations`` chats starting by the workload's
    ``arrival`` at ``rate`` conversations/s, each of a number of turns uniform over the
    inclusive ``turns`` range. Every turn's new user message and output lengths are drawn
    from the workload's ``lengths`` (e.g. sharegpt); turn k+1 resends the history (turn k's
    prompt and actual output) plus its message, ``think_time`` (exponential | fixed) of mean
    ``think_time_s`` seconds after turn k's last token (bench/multi_turn.py)."""

    conversations: int = 16
    turns: list[int] = field(default_factory=lambda: [2, 6])
    think_time: str = "exponential"
    think_time_s: float = 2.0


@dataclass
class AgenticConfig:
    """``workload.agentic``: ``sessions`` agent loops starting by the workload's ``arrival``
    at ``rate`` sessions/s, each of a number of model calls uniform over the inclusive
    ``steps`` range. The first call's prompt is the shared preamble (``prefix_len``) and a
    per-session document of ``document_len`` tokens; every call outputs ``call_output_len``
    tokens (the tool call), and the next call resends the context, that output and a tool
    result of ``tool_result_len`` tokens (inclusive ranges), sent ``tool_latency`` (exponential
    | fixed) of mean ``tool_latency_s`` seconds after the call's last token (bench/agentic.py)."""

    sessions: int = 8
    steps: list[int] = field(default_factory=lambda: [4, 8])
    document_len: list[int] = field(default_factory=lambda: [128, 512])
    call_output_len: list[int] = field(default_factory=lambda: [8, 32])
    tool_result_len: list[int] = field(default_factory=lambda: [16, 128])
    tool_latency: str = "exponential"
    tool_latency_s: float = 0.5


@dataclass
class WorkloadConfig:
    """The requests of one run, deterministic under ``seed``.

    ``arrival``: all_at_once | poisson (``rate`` requests/s) | gamma (mean gap 1/``rate``,
    shape ``burstiness``: 1 is Poisson, below 1 burstier). ``lengths``: fixed
    (``input_len``/``output_len``) | uniform (inclusive ``input_range``/``output_range``) |
    sharegpt (``sharegpt``) | long_prompt (prompt = a uniform fraction in
    ``long_prompt_fraction`` of the context, output from ``output_range``). Every prompt
    starts with one of ``num_prefixes`` shared prefixes of ``prefix_len`` tokens (0 = none).
    ``prompts``: random (token ids) | corpus (windows of ``corpus_file``'s tokens).
    ``arrival: trace`` and ``lengths: trace`` replay the CSV trace at ``path`` (first
    ``num_requests`` rows; its arrival times as recorded unless ``trace_rate`` rescales
    them to that mean rate, which rate sweeps and capacity searches set).
    Lengths are clamped to the model's context: outputs to half of it, prompts to the rest.
    ``tenants`` (name to ``TenantConfig``): several clients, each with its own arrivals,
    lengths, priority and SLO class (bench/tenants.py); empty = one anonymous client.
    ``multi_turn`` or ``agentic`` (null = neither): closed-loop sessions whose next request
    resends the context with the previous output (bench/sessions.py); ``num_requests`` is
    then unused, and the shared prefixes start every session. ``adapters``: LoRA adapter
    names (of the engine's ``lora.adapters``, or a server's adapters) each request draws
    one of; or ``num_adapters`` names ``adapter0`` ...; neither = the base model
    (docs/lora.md). ``adapter_popularity``: ``uniform``, ``zipf`` (adapter i weighs
    (i + 1)^-``adapter_alpha``) or ``power`` (S-LoRA's traces; bench/adapter_popularity.py).
    Under ``executor=simulated`` (with ``lora.enabled``) the ``num_adapters`` adapters are
    registered without weights: adapter i of rank ``adapter_ranks[i % len]`` on
    ``adapter_projections`` of every layer.
    """

    num_requests: int = 32
    seed: int = 0
    arrival: str = "all_at_once"
    rate: float = 4.0
    burstiness: float = 1.0
    lengths: str = "uniform"
    input_len: int = 64
    output_len: int = 32
    input_range: list[int] = field(default_factory=lambda: [16, 128])
    output_range: list[int] = field(default_factory=lambda: [16, 64])
    sharegpt: ShareGPTLengths = field(default_factory=ShareGPTLengths)
    long_prompt_fraction: list[float] = field(default_factory=lambda: [0.5, 0.9])
    prefix_len: int = 0
    num_prefixes: int = 1
    prompts: str = "random"
    corpus_file: Optional[str] = None
    path: Optional[str] = None
    trace_rate: Optional[float] = None
    temperature: float = 0.0
    ignore_eos: bool = True
    tenants: dict[str, Any] = field(default_factory=dict)
    multi_turn: Optional[MultiTurnConfig] = None
    agentic: Optional[AgenticConfig] = None
    adapters: list[str] = field(default_factory=list)
    num_adapters: int = 0
    adapter_popularity: str = "uniform"
    adapter_alpha: float = 1.0
    adapter_ranks: list[int] = field(default_factory=lambda: [16])
    adapter_projections: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class SloConfig:
    """Latency objectives in milliseconds (null = no objective). ``ttft_ms`` and
    ``tpot_ms`` define goodput; ``tbt_p99_ms`` is the capacity search's target, and
    ``scheduling_delay_p50_ms`` its second one when set (Sarathi-Serve: median arrival to
    first scheduled at most 2000 ms); ``normalized_latency_ms`` bounds the mean of E2E /
    output tokens instead of or beside ``tbt_p99_ms`` (PagedAttention's sustained rate)."""

    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    tbt_p99_ms: Optional[float] = None
    scheduling_delay_p50_ms: Optional[float] = None
    normalized_latency_ms: Optional[float] = None


@dataclass
class InprocTargetConfig:
    """``target=inproc``: servelab's ``LLMEngine`` in this process, built from the
    top-level model/cache/attention/scheduler/decoding groups; ``replicas`` engines
    behind the top-level ``router`` (more than one runs under ``executor=simulated``,
    each replica on its own virtual clock)."""

    replicas: int = 1


@dataclass
class HttpTargetConfig:
    """``target=http``: any OpenAI-compatible server, streaming ``endpoint`` at ``url``.

    ``model``: the request's model name (null = the first of ``GET /v1/models``). The
    top-level ``model`` group must describe the served model (vocabulary, tokenizer and
    context length for the prompts); its weights are not loaded.
    """

    url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: Optional[str] = None
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    max_connections: int = 1024


@dataclass
class NoBaselineConfig:
    """``baseline=none``: measure servelab through ``target``."""


@dataclass
class TransformersBaselineConfig:
    """``baseline=transformers``: Hugging Face ``generate`` over static left-padded batches
    of up to ``batch_size`` requests, each run to completion before the next."""

    batch_size: int = 8


@dataclass
class VllmBaselineConfig:
    """``baseline=vllm``: vLLM's ``LLMEngine`` in this process (vLLM must be importable).
    ``engine_args`` are passed to ``vllm.EngineArgs`` (e.g. ``max_num_seqs``)."""

    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunModeConfig:
    """``mode=run``: one measurement of the workload."""


@dataclass
class CapacityModeConfig:
    """``mode=capacity``: the highest Poisson rate (requests/s) in [``rate_low``,
    ``rate_high``] that meets every objective set of ``slo.tbt_p99_ms``,
    ``slo.scheduling_delay_p50_ms`` and ``slo.normalized_latency_ms``; geometric bisection
    of at most ``max_iterations`` runs, stopping when the bracket's high/low - 1 falls
    below ``tolerance``."""

    rate_low: float = 1.0
    rate_high: float = 64.0
    max_iterations: int = 8
    tolerance: float = 0.1


@dataclass
class ProfileModeConfig:
    """``mode=profile``: time this machine's real forward pass over a grid of steps and
    write a step table for ``cost_model=profiled`` (bench/profile.py, docs/simulation.md).
    Prefills of ``token_grid`` tokens (several prompts past the context); decodes of
    ``batch_sizes`` requests at ``context_fractions`` of the context; prefill chunks of
    ``chunk_sizes`` tokens over ``cached_fractions`` of the context; ``prompt_counts`` prompts
    of ``prompt_lengths`` tokens at once; ``mixed_batch_sizes`` decodes with one chunk; and
    ``holdout_steps`` random steps kept out of the fit to check it. Each step is timed
    ``repeats`` times; then ``overhead_rounds`` rounds of ``overhead_requests`` real requests
    measure the engine's time outside the executor. ``out``: also write the table there."""

    repeats: int = 9
    token_grid: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                                                           768, 1024, 1536, 2048])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 48, 64, 96, 128])
    context_fractions: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0])
    chunk_sizes: list[int] = field(default_factory=lambda: [16, 64, 128, 256])
    cached_fractions: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5])
    prompt_counts: list[int] = field(default_factory=lambda: [2, 4, 8])
    prompt_lengths: list[int] = field(default_factory=lambda: [32, 128])
    mixed_batch_sizes: list[int] = field(default_factory=lambda: [4, 16, 64])
    holdout_steps: int = 24
    overhead_requests: int = 128
    overhead_rounds: int = 2
    seed: int = 0
    out: Optional[str] = None


@dataclass
class BenchConfig(EngineConfig):
    """The ``servelab-bench`` app: the engine's groups at the top level (so the composed
    config builds an ``LLMEngine``) plus what to measure and how.

    ``warmup_requests`` short requests run before the measured ones; ``torch_threads``
    sets ``torch.set_num_threads`` (1 avoids oversubscribing a shared CPU); ``label``
    names the job's row in sweep tables (default: the overrides that vary).
    """

    workload: WorkloadConfig = MISSING
    deployment: Any = MISSING
    target: Any = MISSING
    baseline: Any = MISSING
    mode: Any = MISSING
    slo: SloConfig = field(default_factory=SloConfig)
    warmup_requests: int = 2
    torch_threads: Optional[int] = None
    label: Optional[str] = None
    use_tqdm: bool = True


GROUP_OPTIONS = {
    "target": {"inproc": InprocTargetConfig, "http": HttpTargetConfig},
    "baseline": {"none": NoBaselineConfig, "transformers": TransformersBaselineConfig, "vllm": VllmBaselineConfig},
    "mode": {"run": RunModeConfig, "capacity": CapacityModeConfig, "profile": ProfileModeConfig},
}
"""Options of the bench-only groups whose nodes are dataclasses (no YAML files)."""


def product(*factors: float) -> float:
    """``${servelab_product:a,b,...}``: the product of the factors (a per-GPU rate times a
    setup's GPUs, in presets that sweep load per GPU)."""
    result = 1.0
    for factor in factors:
        result *= float(factor)
    return result


def register_bench_resolvers() -> None:
    """Register ``servelab_trace`` (the path of a shipped trace) and ``servelab_product``;
    idempotent. Runs when this module is imported, so a job process of a launcher resolves
    presets too."""
    from omegaconf import OmegaConf

    from servelab.bench.trace import shipped_trace

    if not OmegaConf.has_resolver("servelab_trace"):
        OmegaConf.register_new_resolver("servelab_trace", shipped_trace)
    if not OmegaConf.has_resolver("servelab_product"):
        OmegaConf.register_new_resolver("servelab_product", product)


def store_bench_schemas() -> None:
    """Put ``bench_schema`` and the target/baseline/mode options into Hydra's ConfigStore."""
    register_bench_resolvers()
    store = ConfigStore.instance()
    store.store(name="bench_schema", node=BenchConfig)
    for group, options in GROUP_OPTIONS.items():
        for name, node in options.items():
            store.store(group=group, name=name, node=node)


register_bench_resolvers()
