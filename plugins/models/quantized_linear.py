"""Linear layers with quantized weights (int8 per output channel, int4 group-wise).

The weights are stored in servelab's format (``servelab/kernels/quantized_weights.py``, what the
checkpoint holds). On the CPU, int8 layers multiply through servelab's native weight-only
kernels (``servelab/kernels/quantized_cpu.py``: a copy of the weight repacked once; with
AVX512-VNNI each input row split into three int8 slices for int8 dot products, else the
weights widened to float32 in registers; any number of rows), or, with ``int8_activations`` (w8a8), its int8
x int8 kernel (``servelab/kernels/w8a8_cpu.py``: each input row quantized to int8, int8 dot
products; its torch reference where the kernel is missing); int4 layers through servelab's
native int4 kernels (where the CPU has int8 dot products and the groups are multiples of 8,
``servelab/kernels/w4a8_cpu.py: int4_sliced_linear``: each input row split into int8 slices
multiplied with the nibbles; else ``servelab/kernels/int4_cpu.py``: a copy repacked once, the
nibbles widened to float32 in registers, any number of rows and any even group size), or, with
``int8_activations`` (w4a8), its int4 x int8 kernel (``servelab/kernels/w4a8_cpu.py``: int8
dot products of the nibbles, groups of multiples of 8; its torch reference where the
kernel is missing). On CUDA,
servelab's Triton kernel (``servelab/kernels/quantized_matmul.py``, int4 groups of multiples
of 32) dequantizes the weight tile by tile inside the matmul. Elsewhere (another device or
dtype, no native CPU ops or ``SERVELAB_NATIVE_CPU=0`` on the CPU) the reference runs:
dequantize the whole weight, then ``F.linear``; tests use it as the oracle.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from servelab.core.errors import ConfigError
from servelab.core.quantization import W4A8_GROUP_MULTIPLE, WeightQuantization, group_problems, is_quantized_tensor
from servelab.kernels.cpu_ops import native_cpu_available, native_cpu_enabled
from servelab.kernels.int4_cpu import int4_linear, pack_int4_blocks
from servelab.kernels.quantized_cpu import int8_linear, int8_sliced_linear, pack_int8, slices_on_dot_products
from servelab.kernels.quantized_weights import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from servelab.kernels.w4a8_cpu import int4_sliced_linear, pack_w4a8, w4a8_linear, w4a8_linear_reference
from servelab.kernels.w8a8_cpu import pack_w8a8, w8a8_linear, w8a8_linear_reference, w8a8_unavailable_reason

BITS = (8, 4)
FAST_DTYPES = (torch.float32, torch.bfloat16)
TRITON_GROUP_MULTIPLE = 32
"""int4 group sizes the Triton kernel takes: multiples of its K tile."""


class QuantizedLinear(nn.Module):
    """``y = x @ w.T + bias`` with ``w`` [out_features, in_features] stored as ``bits``-bit
    integers: ``qweight``, ``scales`` (and ``zeros`` for int4, groups of ``group_size``
    input features) as parameters named like the checkpoint's tensors; ``bias`` and the
    scales in ``dtype`` (the activations' dtype). ``int8_activations``: each input row is
    quantized to int8 as well (w8a8, or w4a8 for int4 with groups of multiples of 8). The
    CPU kernels' packed copy is built on
    first use (or by ``pack_quantized_linears``) and rebuilt when a weight changes;
    ``kernel`` is the CPU kernel it goes to (weight-only layers: their activations sliced on
    int8 dot products where the CPU has them, int4 in groups of multiples of 8)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int,
                 dtype: torch.dtype = torch.float32, int8_activations: bool = False):
        super().__init__()
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if int8_activations and bits == 4 and group_size % W4A8_GROUP_MULTIPLE:
            raise ValueError(f"int4 weights with int8 activations need a group size that is a multiple of "
                             f"{W4A8_GROUP_MULTIPLE}, got group_size={group_size}")
        if bits == 4 and (group_size <= 0 or group_size % 2 or in_features % group_size):
            raise ValueError(f"int4 needs an even group size that divides in_features={in_features}, "
                             f"got group_size={group_size}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        self.int8_activations = int8_activations
        if bits == 8:
            self.qweight = _frozen(torch.zeros(out_features, in_features, dtype=torch.int8))
            self.scales = _frozen(torch.ones(out_features, dtype=dtype))
        else:
            groups = in_features // group_size
            self.qweight = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.scales = _frozen(torch.ones(out_features, groups, dtype=dtype))
            self.zeros = _frozen(torch.zeros(out_features, groups, dtype=dtype))
        self.bias = _frozen(torch.zeros(out_features, dtype=dtype)) if bias else None
        self._packed: tuple[tuple, tuple | None] | None = None
        self.kernel = ((w8a8_linear if bits == 8 else w4a8_linear) if int8_activations
                       else int8_linear if bits == 8 else int4_linear)

    def extra_repr(self) -> str:
        """``in_features, out_features, bits, group_size, bias``."""
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        activations = ", int8_activations=True" if self.int8_activations else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{group}"
                f"{activations}, bias={self.bias is not None}")

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out_features, in_features] these integers stand for."""
        dtype = dtype or self.scales.dtype
        if self.bits == 8:
            return dequantize_int8(self.qweight, self.scales, dtype)
        return dequantize_int4(self.qweight, self.scales, self.zeros, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        packed = self.packed_kernel_weights(x)
        if packed is not None:  # a CPU kernel: float32 rows in, float32 out
            out = self.kernel(rows.float().contiguous(), *packed, self.out_features)
        elif self.int8_activations and self.bits == 8:
            out = w8a8_linear_reference(rows.float().contiguous(), self.qweight, self.scales)
        elif self.int8_activations:
            out = w4a8_linear_reference(rows.float().contiguous(), self.qweight, self.scales, self.zeros)
        elif x.device.type == "cuda" and (self.bits == 8 or self.group_size % TRITON_GROUP_MULTIPLE == 0):
            from servelab.kernels.quantized_matmul import quantized_matmul

            out = quantized_matmul(rows.contiguous(), self.qweight, self.scales,
                                   self.zeros if self.bits == 4 else None, self.group_size)
        else:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        bias = self._parameters.get("bias")  # None: no bias (a plain attribute)
        if bias is not None:
            out += bias
        if x.dim() == 2 and x.dtype == torch.float32:  # already the shape and dtype asked for
            return out
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def packed_kernel_weights(self, x: torch.Tensor) -> tuple | None:
        """What the CPU kernel (``kernel``) multiplies ``x`` with: ``pack_w8a8``'s
        (packed weight, offsets, scales) for int8 where the CPU has int8 dot products, else
        ``pack_int8``'s (packed weight, scales), ``pack_w8a8``'s for w8a8, ``pack_w4a8``'s
        for w4a8 and for int4 on int8 dot products, else ``pack_int4_blocks``'; None where
        the reference runs."""
        if x.device.type != "cpu" or x.dtype not in FAST_DTYPES:
            return None
        # Read from the parameter dict: nn.Module's attribute lookup costs about a
        # microsecond each, and this runs for every layer at every step.
        parameters = self._parameters
        qweight, scales = parameters["qweight"], parameters["scales"]
        if x.dtype != scales.dtype or not native_cpu_enabled():
            return None
        key = (qweight._version, qweight.data_ptr(), scales._version, scales.data_ptr())
        if self.bits == 4:
            zeros = parameters["zeros"]
            key += (zeros._version, zeros.data_ptr())
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, self._pack())
        return self._packed[1]

    def share_packed(self, tensors: tuple) -> None:
        """Multiply with ``tensors`` (equal to what ``packed_kernel_weights`` gives: views of
        a stack several layers share) until the weights change."""
        self._packed = (self._packed[0], tensors)

    def _pack(self) -> tuple | None:
        if self.int8_activations:
            if w8a8_unavailable_reason() is not None:
                return None
            with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
                if self.bits == 8:
                    return pack_w8a8(self.qweight, self.scales)
                return pack_w4a8(self.qweight, self.scales, self.zeros)
        if not native_cpu_available():
            return None
        with torch.inference_mode(False):  # normal tensors, usable in and out of inference mode
            if self.bits == 8 and slices_on_dot_products():
                self.kernel = int8_sliced_linear
                return pack_w8a8(self.qweight, self.scales)
            if self.bits == 8:
                self.kernel = int8_linear
                return pack_int8(self.qweight, self.scales)
            if slices_on_dot_products() and self.group_size % W4A8_GROUP_MULTIPLE == 0:
                self.kernel = int4_sliced_linear
                return pack_w4a8(self.qweight, self.scales, self.zeros)
            self.kernel = int4_linear
            return pack_int4_blocks(self.qweight, self.scales, self.zeros)


class QuantizedHead(nn.Module):
    """An LM head that multiplies with quantized weights: int8 (``bits`` 8, one scale per
    vocabulary row) or int4 (``bits`` 4, in groups of ``group_size`` inputs). Its float
    ``weight`` (the embedding's when tied) stays the parameter the checkpoint fills, and a
    ``QuantizedLinear`` quantized from it is built on first use (rebuilt when it changes),
    so saved folders and the embedding lookup keep float weights."""

    def __init__(self, head: nn.Linear, int8_activations: bool, bits: int = 8, group_size: int = -1):
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight, self.bias = head.weight, head.bias
        self.int8_activations, self.bits, self.group_size = int8_activations, bits, group_size
        self._quantized: tuple[tuple, QuantizedLinear] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype."""
        return self.quantized().forward(x)  # no module hooks on the inner layer: skip nn.Module's call

    def quantized(self) -> QuantizedLinear:
        """The quantized layer built from the current float weight."""
        weight = self.weight
        key = (weight._version, weight.data_ptr())
        if self._quantized is None or self._quantized[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # normal tensors, usable in and out of inference mode
                layer = QuantizedLinear(self.in_features, self.out_features, self.bias is not None, self.bits,
                                        self.group_size, weight.dtype, self.int8_activations).to(weight.device)
                quantized = (quantize_int8(weight.detach()) if self.bits == 8
                             else quantize_int4(weight.detach(), self.group_size))
                for name, value in zip(("qweight", "scales", "zeros"), quantized):  # int8: no zeros
                    getattr(layer, name).copy_(value)
                if self.bias is not None:
                    layer.bias.copy_(self.bias)
            self._quantized = (key, layer)
        return self._quantized[1]


def pack_quantized_linears(module: nn.Module) -> int:
    """Build the CPU kernels' packed copy of every ``QuantizedLinear`` (and ``QuantizedHead``)
    of ``module`` (for activations in its scales' dtype), so the first requests do not pay
    it; returns how many layers run a CPU kernel."""
    layers = [layer.quantized() if isinstance(layer, QuantizedHead) else layer for layer in module.modules()
              if isinstance(layer, (QuantizedLinear, QuantizedHead))]
    return sum(layer.packed_kernel_weights(layer.scales.new_empty(0)) is not None for layer in layers)


LAYER_INDEX = re.compile(r"^.*?[.]\d+[.]")
"""A module path's prefix up to its decoder layer's index (``model.layers.3.``)."""


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def quantize_linears(model: torch.nn.Module, quantization: WeightQuantization) -> int:
    """Replace every ``nn.Linear`` inside ``model``'s decoder layers whose weight the
    checkpoint's quantizer rewrites (``is_quantized_tensor``: not the ``FLOAT_KEPT`` ones)
    by an empty ``QuantizedLinear`` of the same size, dtype and device (``load_weights``
    fills it from ``quantized_weights``' tensors), let every module with a
    ``quantize_weights(quantization)`` method store its weights quantized (a mixture's
    stacked experts), and with ``quantization.lm_head`` replace the model's ``lm_head`` by
    a ``QuantizedHead`` over the same float weight; returns how many decoder layers were
    replaced. Decoder weights the quantizer rewrites that are then still float are a
    ``ConfigError`` naming their modules (once for every layer)."""
    if quantization.lm_head and isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        model.lm_head = QuantizedHead(model.lm_head, quantization.int8_activations, quantization.lm_head_bits,
                                      quantization.lm_head_group_size)
    replaced = 0
    for name, module in list(model.named_modules()):
        if callable(getattr(module, "quantize_weights", None)):
            module.quantize_weights(quantization)
        if not (isinstance(module, torch.nn.Linear) and is_quantized_tensor(f"{name}.weight", module.weight)):
            continue
        problems = group_problems(name, module.in_features, quantization.group_size) if quantization.bits == 4 else []
        if problems:
            raise ConfigError(problems)
        parent, _, child = name.rpartition(".")
        layer = QuantizedLinear(module.in_features, module.out_features, module.bias is not None, quantization.bits,
                                quantization.group_size, module.weight.dtype, quantization.int8_activations)
        setattr(model.get_submodule(parent), child, layer.to(module.weight.device))
        replaced += 1
    unquantized = sorted({f"{LAYER_INDEX.sub('', name.rpartition('.')[0])} "
                          f"({type(model.get_submodule(name.rpartition('.')[0])).__name__})"
                          for name, param in model.named_parameters() if is_quantized_tensor(name, param)})
    if unquantized:
        raise ConfigError([f"model.quantization: {type(model).__name__} has decoder weights weight quantization "
                           f"does not cover: {', '.join(unquantized)}"])
    return replaced
