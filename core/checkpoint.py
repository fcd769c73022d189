"""Find and read a model: a Hugging Face folder, or a shape given in the config (random
weights built in memory, or no weights at all for simulation)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from servelab.core.errors import ConfigError
from servelab.core.quantization import WeightQuantization, quantized_weights, resolve_quantization
from servelab.core.shape_config import shape_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A model ready to instantiate: its Hugging Face config, tokenizer (None for a shape
    without one), architecture name, a callable yielding (name, tensor) weights (None for
    a shape without weights; quantized ones when ``quantization`` is set, whether the
    checkpoint holds them so or they are quantized as they are read), where it came from
    (``source``) and how its decoder's linear layers are quantized (None: float)."""

    hf_config: Any
    tokenizer: Any
    architecture: str
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None
    source: str
    quantization: WeightQuantization | None = None


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError([f"device={name!r} but CUDA is not available; use device=cpu or device=auto"])
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any, device: torch.device, runs_model: bool = True) -> torch.dtype:
    """``auto`` is float32 on a CPU that runs the model, else the checkpoint's dtype."""
    if name == "auto":
        if device.type == "cpu" and runs_model:
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
    shape = model_config.shape
    if shape is not None:
        from servelab.checkpoints import toy

        tokenizer = toy.byte_level_tokenizer() if shape.random_weights else None
        if model_config.tokenizer:
            tokenizer = _tokenizer(model_config.tokenizer)
        vocab = shape.vocab_size or (len(tokenizer) if tokenizer is not None else None)
        if vocab is None:
            raise ConfigError(["model.shape.vocab_size is not set and the shape has no tokenizer to count it"])
        hf_config = shape_config(shape, vocab, getattr(tokenizer, "eos_token_id", None))
        quantization = resolve_quantization(model_config, None)
        weights = (lambda: toy.random_weights(hf_config, model_config.seed)) if shape.random_weights else None
        return Checkpoint(hf_config, tokenizer, shape.architecture, _quantizing(weights, quantization), "shape",
                          quantization)
    folder = model_config.path
    if not folder:
        raise ConfigError(["model.path is not set: give a Hugging Face folder or pick a preset (model=tiny)"])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError([f"model.path={folder!r} is not a Hugging Face model folder (no config.json)"])
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ConfigError([f"{folder}/config.json names no 'architectures'"])
    quantization = resolve_quantization(model_config, hf_config)
    tokenizer = _tokenizer(model_config.tokenizer or folder)
    return Checkpoint(hf_config, tokenizer, architectures[0],
                      _quantizing(lambda: iter_folder_weights(folder), quantization), folder, quantization)


def _quantizing(weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None,
                quantization: WeightQuantization | None) -> Callable[[], Iterable[tuple[str, torch.Tensor]]] | None:
    """``weights``, quantized as they are read when ``quantization`` asks for it and the
    checkpoint holds floating-point weights."""
    if weights is None or quantization is None or quantization.prequantized:
        return weights
    return lambda: quantized_weights(weights(), quantization)


def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ConfigError([f"cannot load a tokenizer from {folder!r} (model.tokenizer): {exc}"]) from exc
