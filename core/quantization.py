"""Weight quantization as a model option: which mode a model is served in, the start-up
checks, the checkpoint tensors it rewrites and the layers it replaces (docs/quantization.md).

``model.quantization``: auto (the folder's own: quantized when its config.json has a
servelab ``quantization_config``, else float) | none | int8 | w8a8 | int4 | w4a8, and
``model.quantization_group_size`` (int4 and w4a8, default 128). Every linear layer inside
the decoder layers (``model.layers.*``: attention and MLP projections) is quantized; the
embeddings, norms and LM head stay in floating point (the LM head quantized too with
``model.quantization_lm_head``). ``w8a8`` and ``w4a8`` store int8 and
int4 weights as ``int8`` and ``int4`` do and also quantize each activation row to int8 at
every call (CPUs with AVX512-VNNI only).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from servelab.core.errors import ConfigError

MODES = ("auto", "none", "int8", "w8a8", "int4", "w4a8")
INT8_ACTIVATION_MODES = {8: "w8a8", 4: "w4a8"}
"""The mode that quantizes activations to int8 too, by weight bits."""
W4A8_GROUP_MULTIPLE = 8
"""w4a8's group sizes are multiples of this (its kernel reads 8 inputs of a channel at a time)."""
DEFAULT_GROUP_SIZE = 128
LM_HEAD_BITS = {False: None, True: 8, "int8": 8, "int4": 4}
"""``model.quantization_lm_head``'s values and the LM head's bits each gives (None: float)."""
QUANT_METHOD = "servelab"
DECODER_PREFIX = "model.layers."
"""Checkpoint tensors and model modules below this prefix are the quantized ones."""


@dataclass(frozen=True, slots=True)
class WeightQuantization:
    """How the decoder's linear layers store their weights: ``bits`` 8 (int8, one scale per
    output channel; ``group_size`` -1) or 4 (int4 in groups of ``group_size`` input
    features). ``prequantized``: the checkpoint already holds the integers (a folder
    written by ``python -m servelab.core.entrypoints.quantize``), else they are computed at load.
    ``int8_activations``: activation rows are quantized to int8 at every call and
    multiplied with int8 dot products (``model.quantization=w8a8`` for int8 weights,
    ``w4a8`` for int4).
    ``lm_head``: the LM head multiplies with quantized weights too (with int8 activations
    under w8a8 and w4a8, float ones under int8 and int4), quantized at load from its float
    weight (``model.quantization_lm_head``): ``lm_head_bits`` 8 (one scale per vocabulary
    row) or 4 (int4 layers only: in their groups of ``group_size``)."""

    bits: int
    group_size: int
    prequantized: bool = False
    int8_activations: bool = False
    lm_head: bool = False
    lm_head_bits: int = 8

    @property
    def mode(self) -> str:
        """``int8``, ``w8a8``, ``int4`` or ``w4a8``: the ``model.quantization`` value."""
        return INT8_ACTIVATION_MODES[self.bits] if self.int8_activations else f"int{self.bits}"

    def bytes_per_weight(self, in_features: int, scale_bytes: float) -> float:
        """Stored bytes per weight of a layer with ``in_features`` inputs: the integer and
        its share of the scales (and int4 zeros), ``scale_bytes`` each."""
        if self.bits == 8:
            return 1.0 + scale_bytes / in_features
        return 0.5 + 2.0 * scale_bytes / self.group_size

    @property
    def lm_head_group_size(self) -> int:
        """Inputs per scale of the quantized LM head: the layers' groups for int4, -1 (one
        scale per vocabulary row) for int8."""
        return self.group_size if self.lm_head_bits == 4 else -1

    def head_bytes_per_weight(self, in_features: int, scale_bytes: float) -> float:
        """Stored bytes per weight of the quantized LM head (``in_features`` inputs)."""
        return WeightQuantization(self.lm_head_bits, self.lm_head_group_size).bytes_per_weight(in_features,
                                                                                               scale_bytes)

    def config_entry(self) -> dict:
        """The ``quantization_config`` entry of a saved folder's config.json."""
        return {"quant_method": QUANT_METHOD, "bits": self.bits, "group_size": self.group_size}


def stored_quantization(hf_config: Any) -> WeightQuantization | None:
    """The quantization a folder's config.json declares (None for a float checkpoint)."""
    entry = getattr(hf_config, "quantization_config", None)
    if not entry:
        return None
    entry = entry if isinstance(entry, dict) else entry.to_dict()
    method, bits, group_size = entry.get("quant_method"), entry.get("bits"), entry.get("group_size")
    if method != QUANT_METHOD or bits not in (8, 4) or not isinstance(group_size, int):
        raise ConfigError([f"config.json's quantization_config {entry} is not one servelab loads: expected "
                           f"quant_method={QUANT_METHOD!r}, bits 8 or 4 and an integer group_size"])
    return WeightQuantization(bits, group_size, prequantized=True)


def resolve_quantization(model_config: Any, hf_config: Any | None) -> WeightQuantization | None:
    """The quantization ``model_config`` (a ``ModelConfig``) asks for on a checkpoint whose
    config is ``hf_config`` (None for a shape); None serves float weights."""
    mode = getattr(model_config, "quantization", "auto")
    group_size = getattr(model_config, "quantization_group_size", None)
    problems = []
    if mode not in MODES:
        problems.append(f"model.quantization must be one of {', '.join(MODES)}, got {mode!r}")
    if group_size is not None and (group_size <= 0 or group_size % 2):
        problems.append(f"model.quantization_group_size must be a positive even number, got {group_size}")
    stored = stored_quantization(hf_config) if hf_config is not None else None
    if stored is not None and mode == INT8_ACTIVATION_MODES[stored.bits]:
        stored = dataclasses.replace(stored, int8_activations=True)
    if stored is not None and mode not in ("auto", stored.mode):
        problems.append(f"model.quantization={mode} but the checkpoint holds {stored.mode} weights "
                        f"(quantization_config in its config.json): use model.quantization=auto or {stored.mode}, "
                        f"or start from the floating-point checkpoint")
    if stored is not None and stored.bits == 4 and group_size not in (None, stored.group_size):
        problems.append(f"model.quantization_group_size={group_size} but the checkpoint's int4 weights are in "
                        f"groups of {stored.group_size}")
    quantization = stored
    if stored is None and mode in ("int8", "w8a8"):
        quantization = WeightQuantization(8, -1, int8_activations=mode == "w8a8")
    elif stored is None and mode in ("int4", "w4a8"):
        quantization = WeightQuantization(4, group_size or DEFAULT_GROUP_SIZE, int8_activations=mode == "w4a8")
    if (quantization is not None and quantization.mode == "w4a8"
            and quantization.group_size % W4A8_GROUP_MULTIPLE):
        problems.append(f"model.quantization=w4a8 needs model.quantization_group_size a multiple of "
                        f"{W4A8_GROUP_MULTIPLE}, got {quantization.group_size}")
    head = getattr(model_config, "quantization_lm_head", False)
    head_bits = LM_HEAD_BITS.get(head) if type(head) in (bool, str) else None
    shown = str(head).lower() if type(head) is bool else head
    if head_bits is None and head is not False:
        problems.append(f"model.quantization_lm_head must be false, true (int8), int8 or int4, got {head!r}")
    elif head_bits and quantization is None:
        problems.append(f"model.quantization_lm_head={shown} needs quantized weights (model.quantization=int8, "
                        f"w8a8, int4 or w4a8), got model.quantization={mode}")
    elif head_bits == 4 and quantization.bits != 4:
        problems.append(f"model.quantization_lm_head=int4 needs int4 layers (model.quantization=int4 or w4a8), "
                        f"whose group size it takes; got model.quantization={quantization.mode}")
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(quantization, lm_head=True, lm_head_bits=head_bits) if head_bits else quantization


def quantization_problems(quantization: WeightQuantization | None, shape: Any, tensor_parallel_size: int,
                          device: torch.device, runs_model: bool) -> list[str]:
    """Why ``quantization`` cannot serve a model of ``shape`` (a ``ModelShape``) on
    ``device`` split over ``tensor_parallel_size`` ranks (empty when it can). An executor
    that runs no model (``runs_model`` False) needs no kernel, only groups that divide."""
    if quantization is None:
        return []
    mode = quantization.mode
    problems = []
    if runs_model and quantization.int8_activations:
        from servelab.kernels.w8a8_cpu import w8a8_unavailable_reason

        reason = w8a8_unavailable_reason() if device.type == "cpu" else f"it runs on the CPU only, not on {device}"
        if reason is not None:
            problems.append(f"model.quantization={mode} cannot run here: {reason}; model.quantization="
                            f"int{quantization.bits} keeps the activations in floating point and runs everywhere")
    elif runs_model and device.type == "cuda" and importlib.util.find_spec("triton") is None:
        problems.append(f"model.quantization={mode} on device={device} needs the 'triton' package for its "
                        f"matmul kernel, which is not installed")
    elif runs_model and device.type not in ("cpu", "cuda"):
        problems.append(f"model.quantization={mode} has no kernel on device={device}: quantized weights run on "
                        f"the CPU and CUDA (Triton)")
    if quantization.bits == 4:
        layers: dict[tuple[int, int], list[str]] = {}  # (in_features, ranks sharing them) -> layer names
        for name, in_features in shape.linear_in_features(tensor_parallel_size).items():
            ranks = tensor_parallel_size if name.endswith(("o_proj", "down_proj")) else 1
            layers.setdefault((in_features, ranks), []).append(f"model.layers.*.{name}")
        for (in_features, ranks), names in layers.items():
            problems += group_problems(", ".join(names), in_features, quantization.group_size, ranks)
    return problems


def group_problems(layer: str, in_features: int, group_size: int, ranks: int = 1) -> list[str]:
    """Why int4 groups of ``group_size`` cannot split ``layer``'s ``in_features`` (one
    rank's share when ``ranks`` > 1)."""
    if in_features % group_size == 0:
        return []
    share = f" (its share on each of {ranks} tensor-parallel ranks)" if ranks > 1 else ""
    return [f"model.quantization_group_size={group_size} does not divide in_features={in_features} of "
            f"{layer}{share}; pick a group size that divides it"]


def weight_memory_bytes(shape: Any, quantization: WeightQuantization | None, dtype_bytes: float) -> float:
    """Bytes of every weight of a model of ``shape`` (a ``ModelShape``) in ``dtype_bytes``
    floats, its decoder linear layers stored as ``quantization`` asks (None: floats), plus
    the quantized copy of the LM head that ``lm_head`` keeps beside its float weight (a
    mixture of experts' matrices too)."""
    total = shape.num_parameters * dtype_bytes
    if quantization is None:
        return total

    def saved(matrices: Iterable[tuple[int, int]]) -> float:
        return sum(outputs * inputs * (dtype_bytes - quantization.bytes_per_weight(inputs, dtype_bytes))
                   for outputs, inputs in matrices)

    total -= shape.num_layers * saved(shape.linear_shapes().values())
    if shape.experts is not None:  # a sparse layer's experts in place of its dense MLP
        dense_mlp = [size for name, size in shape.linear_shapes().items() if name.startswith("mlp.")]
        total -= shape.experts.sparse_layers(shape.num_layers) * (
            saved(shape.experts.linear_shapes(shape.hidden_size)) - saved(dense_mlp))
    if quantization.lm_head:
        total += shape.vocab_size * shape.hidden_size * quantization.head_bytes_per_weight(shape.hidden_size,
                                                                                         dtype_bytes)
    return total


FLOAT_KEPT = ("gate", "shared_expert_gate", "kv_b_proj")
"""Decoder layers whose weights stay in float: a mixture of experts' router and its shared
expert's gate (small, and they decide where tokens go), MLA's ``kv_b_proj`` (multiplied
in pieces, no linear layer)."""


def is_quantized_tensor(name: str, tensor: torch.Tensor) -> bool:
    """True for a checkpoint tensor that ``quantized_weights`` rewrites: a 2-D ``weight``
    of a layer inside the decoder layers, other than the ``FLOAT_KEPT`` ones."""
    return (name.startswith(DECODER_PREFIX) and name.endswith(".weight") and tensor.dim() == 2
            and name.split(".")[-2] not in FLOAT_KEPT)


def quantized_weights(weights: Iterable[tuple[str, torch.Tensor]],
                      quantization: WeightQuantization) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with every decoder linear weight ``<layer>.weight`` [N, K]
    replaced by ``<layer>.qweight`` and ``<layer>.scales`` (and ``<layer>.zeros`` for int4)
    in servelab's format (``servelab/kernels/quantized_weights.py``); the rest pass unchanged."""
    from servelab.kernels.quantized_weights import quantize_int4, quantize_int8

    for name, tensor in weights:
        if not is_quantized_tensor(name, tensor):
            yield name, tensor
            continue
        layer = name[:-len(".weight")]
        if quantization.bits == 8:
            qweight, scales = quantize_int8(tensor)
            yield from ((f"{layer}.qweight", qweight), (f"{layer}.scales", scales))
            continue
        problems = group_problems(layer, tensor.shape[1], quantization.group_size)
        if problems:
            raise ConfigError(problems)
        qweight, scales, zeros = quantize_int4(tensor, quantization.group_size)
        yield from ((f"{layer}.qweight", qweight), (f"{layer}.scales", scales), (f"{layer}.zeros", zeros))
