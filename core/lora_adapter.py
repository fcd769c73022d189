"""LoRA adapters in PEFT's format: a folder with ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), read into host tensors.

Each adapted module ``m`` adds ``scale * B(A(x))`` to its output, with ``A`` [r, in],
``B`` [out, r] and ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``); ``rank_pattern`` and ``alpha_pattern`` set them per module, matched as
PEFT matches them. The scale is folded into ``B`` here. Anything servelab does not apply
(DoRA, trained biases, ``modules_to_save``, embedding adapters, ``fan_in_fan_out``) is
refused, naming the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from servelab.core.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_REFUSED_FLAGS = (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) adapters"),
                  ("lora_bias", "adapters with trained LoRA biases"))


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted module: ``name`` as in the Hugging Face checkpoint
    (``model.layers.0.self_attn.q_proj``), ``a`` [rank, in_features] and ``b``
    [out_features, rank] with the adapter's scale folded in (float32, host memory)."""

    name: str
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        """The module's LoRA rank."""
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter read from ``path`` and registered as ``name``; ``load_id`` tells apart two
    loads under one name (an adapter replaced at run time), ``modules`` its weights."""

    name: str
    path: str
    load_id: int
    modules: tuple[LoRAModule, ...]

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(module.rank for module in self.modules)

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of its requests: blocks cached under one adapter (and one
        load of it) are never reused by another or by the base model."""
        return f"lora:{self.name}:{self.load_id}"

    def salted(self, cache_salt: str | None) -> str:
        """A request's ``cache_salt`` (None: none) joined with this adapter's."""
        return self.cache_salt if cache_salt is None else f"{cache_salt}|{self.cache_salt}"

    @property
    def num_bytes(self) -> int:
        """Bytes of its host weights."""
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules)


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """The value of the first ``rank_pattern`` / ``alpha_pattern`` key matching ``module``
    (a whole dotted suffix or regular expression, as PEFT matches them), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: str) -> dict:
    """``adapter_config.json``, checked for what servelab applies."""
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise InvalidRequestError("lora_path", f"{path!r} is not a folder")
    if not os.path.isfile(config_file):
        raise InvalidRequestError("lora_path", f"{path!r} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    try:
        with open(config_file) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError("lora_path", f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise InvalidRequestError("peft_type", f"{config_file}: only LoRA adapters are served (peft_type 'LORA'), "
                                               f"got {kind!r}")
    for flag, what in _REFUSED_FLAGS:
        if config.get(flag):
            raise InvalidRequestError(flag, f"{config_file}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError("bias", f"{config_file}: adapters that train biases are not supported "
                                          f"(bias must be 'none', got {config['bias']!r})")
    if config.get("modules_to_save"):
        raise InvalidRequestError("modules_to_save", f"{config_file}: adapters that replace whole modules "
                                                     f"({config['modules_to_save']}) are not supported")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    """The adapter's weight file (safetensors first)."""
    for file_name in WEIGHT_FILES:
        weight_file = os.path.join(path, file_name)
        if not os.path.isfile(weight_file):
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(weight_file)
            return torch.load(weight_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: say which
            raise InvalidRequestError("lora_path", f"cannot read {weight_file}: {exc}") from exc
    raise InvalidRequestError("lora_path", f"{path!r} is not a PEFT adapter folder: it has none of "
                                           f"{', '.join(WEIGHT_FILES)}")


def read_peft_adapter(name: str, path: str, max_rank: int, load_id: int = 0) -> LoRAAdapter:
    """Read the PEFT adapter folder ``path`` as ``name``; ``InvalidRequestError`` naming the
    field for a folder that is not a LoRA adapter, a feature servelab does not apply, or a
    rank above ``max_rank``."""
    config = _read_config(path)
    tensors = _read_tensors(path)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise InvalidRequestError("lora_path", f"{path}: weight {key!r} is not a LoRA A or B matrix (embedding "
                                                   f"adapters and other PEFT methods are not supported)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise InvalidRequestError("lora_path", f"{path}: the adapter has no LoRA weights")
    modules = []
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"} or pair["A"].dim() != 2 or pair["B"].dim() != 2 or \
                pair["A"].shape[0] != pair["B"].shape[1]:
            shapes = {part: tuple(t.shape) for part, t in pair.items()}
            raise InvalidRequestError("lora_path", f"{path}: module {module!r} needs lora_A [r, in] and lora_B "
                                                   f"[out, r], got {shapes}")
        rank = pair["A"].shape[0]
        if rank > max_rank:
            raise InvalidRequestError("r", f"{path}: module {module!r} has rank {rank}, above lora.max_rank="
                                           f"{max_rank}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules.append(LoRAModule(module, pair["A"].float().contiguous(), (pair["B"].float() * scale).contiguous()))
    return LoRAAdapter(name, os.path.abspath(path), load_id, tuple(modules))
