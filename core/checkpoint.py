"""Find and read a model: Hugging Face folder or in-memory random model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from servelab.core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A model ready to instantiate: its Hugging Face config, tokenizer, architecture name
    and a callable yielding (name, tensor) weights."""

    hf_config: Any
    tokenizer: Any
    architecture: str
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    source: str


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError([f"device={name!r} but CUDA is not available; use device=cpu or device=auto"])
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and the checkpoint's dtype elsewhere."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = DTYPES.get(stored)
        return stored if stored in DTYPES.values() else torch.float32
    if name not in DTYPES:
        raise ConfigError([f"model.dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}"])
    return DTYPES[name]


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def iter_folder_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face folder: safetensors (sharded or not) or pytorch_model.bin."""
    files = _safetensors_files(folder)
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    binary = os.path.join(folder, "pytorch_model.bin")
    if not os.path.exists(binary):
        raise ConfigError([f"model.path={folder!r} holds no *.safetensors or pytorch_model.bin weights"])
    yield from torch.load(binary, map_location="cpu", weights_only=True).items()


def load_checkpoint(model_config: Any) -> Checkpoint:
    """Read config and tokenizer of ``model_config`` (a ``ModelConfig``); weights stay lazy."""
    if model_config.random_init is not None:
        from servelab.checkpoints import toy

        tokenizer = toy.byte_level_tokenizer()
        hf_config = toy.random_llama_config(model_config.random_init, len(tokenizer), tokenizer.eos_token_id)
        return Checkpoint(hf_config, tokenizer, "LlamaForCausalLM",
                          lambda: toy.random_llama_weights(hf_config, model_config.seed), "toy")
    folder = model_config.path
    if not folder:
        raise ConfigError(["model.path is not set: give a Hugging Face folder or pick a preset (model=tiny)"])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError([f"model.path={folder!r} is not a Hugging Face model folder (no config.json)"])
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(folder)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ConfigError([f"{folder}/config.json names no 'architectures'"])
    tokenizer_folder = model_config.tokenizer or folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    except Exception as exc:
        raise ConfigError([f"cannot load a tokenizer from {tokenizer_folder!r} (model.tokenizer): {exc}"]) from exc
    return Checkpoint(hf_config, tokenizer, architectures[0], lambda: iter_folder_weights(folder), folder)
