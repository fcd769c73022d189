"""The requests of one benchmark run, built from a ``WorkloadConfig`` and the model's limits."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from servelab.bench.adapter_popularity import adapter_draw, adapter_names
from servelab.bench.arrivals import arrival_offsets
from servelab.bench.lengths import clamp_lengths, sample_lengths
from servelab.bench.prompts import PromptSource
from servelab.bench.trace import read_trace, trace_offsets
from servelab.core.errors import ConfigError
from servelab.core.request_metadata import RequestMetadata


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """What a workload needs to know about the served model: ``vocab_size`` token ids,
    ``max_model_len`` tokens per sequence (prompt + output), its ``tokenizer`` (or None)."""

    vocab_size: int
    max_model_len: int
    tokenizer: Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: ``prompt_token_ids``, exactly ``max_tokens`` outputs wanted
    (with ``ignore_eos``), sent ``arrival_offset_s`` seconds after the run starts;
    ``metadata`` (tenant, priority, SLO class) when the workload has tenants; ``lora``, the
    LoRA adapter it runs with (None: the base model)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_offset_s: float
    metadata: RequestMetadata | None = None
    lora: str | None = None


def model_token_space(model_cfg: Any) -> TokenSpace:
    """The ``TokenSpace`` of a ``ModelConfig`` from its config and tokenizer (no weights)."""
    from servelab.core.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(model_cfg)
    hf = checkpoint.hf_config
    return TokenSpace(hf.vocab_size, model_cfg.max_model_len or hf.max_position_embeddings, checkpoint.tokenizer)


def workload_preset(name: str, **fields: Any) -> Any:
    """The ``workload=<name>`` preset (``conf/workload/<name>.yaml`` over ``WorkloadConfig``'s
    defaults) with ``fields`` set on top: what ``servelab-bench workload=<name>`` composes,
    for scripts that build the same requests without Hydra."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    from servelab.bench.config import WorkloadConfig

    preset = files("servelab.conf").joinpath("workload", f"{name}.yaml")
    if not preset.is_file():
        raise ConfigError([f"workload={name}: no conf/workload/{name}.yaml"])
    return OmegaConf.merge(OmegaConf.structured(WorkloadConfig), OmegaConf.create(preset.read_text()), fields)


def build_workload(cfg: Any, space: TokenSpace, rate: float | None = None, prefix: str = "") -> list[BenchRequest]:
    """The requests of ``cfg`` (a ``WorkloadConfig``), sorted by arrival; ``rate``
    overrides ``cfg.rate`` (capacity search; with tenants, their total rate). Independent
    random streams for arrivals, lengths and prompts, so changing one leaves the others
    unchanged. Closed-loop workloads (``multi_turn``, ``agentic``) are built by
    ``bench.sessions.build_sessions`` instead."""
    closed = [name for name in ("multi_turn", "agentic") if getattr(cfg, name, None) is not None]
    if closed:
        raise ConfigError([f"workload.{closed[0]} is closed-loop (each request waits for the previous output): "
                           f"build it with servelab.bench.sessions.build_sessions"])
    if getattr(cfg, "tenants", None):
        from servelab.bench.tenants import build_tenant_workload

        return build_tenant_workload(cfg, space, rate, prefix)
    return client_requests(cfg, space, rate, prefix, str(cfg.seed))


def client_requests(cfg: Any, space: TokenSpace, rate: float | None, prefix: str, seed: str,
                    metadata: RequestMetadata | None = None) -> list[BenchRequest]:
    """The requests of one client's ``cfg`` (``tenants`` ignored), ids ``<prefix><i>``,
    drawn from random streams named by ``seed``, each carrying ``metadata``."""
    if cfg.num_requests < 1:
        raise ConfigError([f"workload.num_requests must be >= 1, got {cfg.num_requests}"])
    rows = read_trace(cfg.path, cfg.num_requests) if "trace" in (cfg.arrival, cfg.lengths) else []
    if cfg.arrival == "trace":
        offsets = trace_offsets(rows, cfg.trace_rate if rate is None else rate)
    else:
        offsets = arrival_offsets(cfg.arrival, cfg.num_requests, cfg.rate if rate is None else rate, cfg.burstiness,
                                  random.Random(f"{seed}:arrivals"))
    if cfg.lengths == "trace":
        pairs = [(row.prompt_tokens, row.output_tokens) for row in rows]
    else:
        pairs = sample_lengths(cfg, space.max_model_len, random.Random(f"{seed}:lengths"))
    source = PromptSource(cfg.prompts, space.vocab_size, space.tokenizer, cfg.corpus_file, random.Random(f"{seed}:prompts"))
    shared_prefix = shared_prefixes(cfg, source, seed)
    next_adapter = adapter_draw(cfg, adapter_names(cfg), random.Random(f"{seed}:adapters"))
    requests = []
    for i, (offset, (unique_len, output_len)) in enumerate(zip(offsets, pairs)):
        shared = shared_prefix()
        prompt_len, output_len = clamp_lengths(len(shared) + unique_len, output_len, space.max_model_len)
        head = shared[:prompt_len]
        prompt = head + source.draw(prompt_len - len(head))
        requests.append(BenchRequest(f"{prefix}{i}", tuple(prompt), output_len, offset, metadata, next_adapter()))
    return requests


def shared_prefixes(cfg: Any, source: PromptSource, seed: str) -> Callable[[], list[int]]:
    """The workload's ``num_prefixes`` shared prefixes of ``prefix_len`` tokens (the system
    prompts), drawn from ``source``; returns a function that picks one at random (from the
    stream ``<seed>:prefixes``) per call, ``[]`` when ``prefix_len`` is 0."""
    problems = [f"workload.{name} must be >= {low}, got {value}" for name, value, low in
                (("prefix_len", cfg.prefix_len, 0), ("num_prefixes", cfg.num_prefixes, 1)) if value < low]
    if problems:
        raise ConfigError(problems)
    prefixes = [source.draw(cfg.prefix_len) for _ in range(cfg.num_prefixes)] if cfg.prefix_len > 0 else [[]]
    pick = random.Random(f"{seed}:prefixes")
    return lambda: prefixes[pick.randrange(len(prefixes))]


def warmup_workload(space: TokenSpace, num_requests: int) -> list[BenchRequest]:
    """Short random requests, all at once, run before the measured ones (not counted)."""
    source = PromptSource("random", space.vocab_size, space.tokenizer, None, random.Random("warmup"))
    prompt_len, output_len = clamp_lengths(16, 4, space.max_model_len)
    return [BenchRequest(f"warmup-{i}", tuple(source.draw(prompt_len)), output_len, 0.0) for i in range(num_requests)]
