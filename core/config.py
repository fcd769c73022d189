"""Top-level config schemas (Hydra structured configs) shared by every servelab app."""

from __future__ import annotations

import importlib.resources
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class RandomModelConfig:
    """A Llama with random weights built in memory (``model=toy``), byte-level tokenizer."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512


@dataclass
class ModelConfig:
    """Which checkpoint to serve and how.

    ``path``: a Hugging Face folder (config.json + safetensors + tokenizer). ``random_init``:
    build a random model instead (no files). ``dtype``: auto | float32 | bfloat16 | float16
    (auto = float32 on CPU, the checkpoint's dtype on GPU). ``max_model_len``: prompt +
    output limit per sequence (default: the model's ``max_position_embeddings``).
    """

    path: Optional[str] = None
    random_init: Optional[RandomModelConfig] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0


@dataclass
class SamplingConfig:
    """Default ``SamplingParams`` for prompts given on the command line."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 64
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1


@dataclass
class EngineConfig:
    """What every servelab app composes to build an ``LLMEngine``: the model and one
    option of each component group (filled from the registry), on ``device``."""

    model: ModelConfig = MISSING
    cache: Any = MISSING
    attention: Any = MISSING
    scheduler: Any = MISSING
    decoding: Any = MISSING
    device: str = "auto"


@dataclass
class ServelabConfig(EngineConfig):
    """The ``servelab`` app: engine components plus the prompts to complete."""

    prompt: Optional[str] = None
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


register_resolvers()
