"""LoRA adapters in PEFT's format (``adapter_config.json`` and its weights, as a
``LoRAStore`` reads them), checked and turned into host tensors per module.

Each adapted module ``m`` adds ``scale * B(A(x))`` to its output, with ``A`` [r, in],
``B`` [out, r] and ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``); ``rank_pattern`` and ``alpha_pattern`` set them per module, matched as
PEFT matches them. The scale is folded into ``B`` here. Anything servelab does not apply
(DoRA, trained biases, ``modules_to_save``, embedding adapters, ``fan_in_fan_out``) is
refused, naming the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from servelab.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from servelab.core.lora_store import StoredAdapter

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


def _check_config(config: dict, source: str) -> None:
    """``adapter_config.json`` (read from ``source``) checked for what servelab applies."""
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise InvalidRequestError("peft_type", f"{source}: only LoRA adapters are served (peft_type 'LORA'), "
                                               f"got {kind!r}")
    for flag, what in _REFUSED_FLAGS:
        if config.get(flag):
            raise InvalidRequestError(flag, f"{source}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError("bias", f"{source}: adapters that train biases are not supported "
                                          f"(bias must be 'none', got {config['bias']!r})")
    if config.get("modules_to_save"):
        raise InvalidRequestError("modules_to_save", f"{source}: adapters that replace whole modules "
                                                     f"({config['modules_to_save']}) are not supported")


def adapter_from_peft(name: str, stored: StoredAdapter, max_rank: int, load_id: int = 0) -> LoRAAdapter:
    """The adapter ``stored`` (as a ``LoRAStore`` read it) registered as ``name``;
    ``InvalidRequestError`` naming the field for a config or weights that are not a LoRA
    adapter, a feature servelab does not apply, or a rank above ``max_rank``."""
    config, tensors, path = stored.config, stored.tensors, stored.source
    _check_config(config, path)
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
    return LoRAAdapter(name, path, load_id, tuple(modules))
