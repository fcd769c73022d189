"""``LoRALinear`` adds each token's adapter update to any projection's output: a float
``Linear`` or a ``QuantizedLinear`` (whose internals it does not touch), a fused part
landing on its own output rows, tokens of the base model left alone."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.quantized_weights import quantize_int8
from servelab.plugins.models.linear import Linear
from servelab.plugins.models.lora_linear import LoRABatch, LoRALinear
from servelab.plugins.models.quantized_linear import QuantizedLinear


def float_layer(weight: torch.Tensor) -> torch.nn.Module:
    layer = Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer


def int8_layer(weight: torch.Tensor) -> torch.nn.Module:
    layer = QuantizedLinear(weight.shape[1], weight.shape[0], bias=False, bits=8, group_size=0)
    qweight, scales = quantize_int8(weight)
    layer.qweight.data.copy_(qweight)
    layer.scales.data.copy_(scales)
    return layer


@pytest.mark.parametrize("make", [float_layer, int8_layer], ids=["linear", "int8"])
def test_each_token_gets_its_slots_update(make):
    torch.manual_seed(0)
    base = make(torch.randn(24, 16))
    batch = LoRABatch()
    layer = LoRALinear(base, batch, num_slots=2, width=8, dtype=torch.float32, device=torch.device("cpu"))
    a0, b0 = torch.randn(4, 16), torch.randn(24, 4)  # slot 0: the whole output
    a1, b1 = torch.randn(2, 16), torch.randn(8, 2)   # slot 1: a fused part, output rows 8..15
    layer.place(0, 0, a0, b0)
    layer.place(1, 8, a1, b1)
    x = torch.randn(5, 16)
    expected = base(x).clone()
    expected[[0, 3]] += x[[0, 3]] @ a0.t() @ b0.t()
    expected[[1], 8:16] += x[[1]] @ a1.t() @ b1.t()
    batch.rows, batch.groups = torch.tensor([0, 3, 1]), [(0, 0, 2), (1, 2, 3)]
    torch.testing.assert_close(layer(x), expected)
    batch.rows, batch.groups = None, [(1, 0, 5)]
    everyone = base(x).clone()
    everyone[:, 8:16] += x @ a1.t() @ b1.t()
    torch.testing.assert_close(layer(x), everyone)
    layer.clear(1)
    torch.testing.assert_close(layer(x), base(x))


def test_segments_through_the_triton_kernel_equal_token_groups():
    """The CUDA path (one segment per request, the Triton kernel; here in its interpreter)
    gives what the grouped CPU path gives."""
    pytest.importorskip("triton")
    from servelab.kernels.availability import triton_interpret_enabled

    if not triton_interpret_enabled() and not torch.cuda.is_available():
        pytest.skip("Triton runs neither in its interpreter nor on a GPU here")
    torch.manual_seed(0)
    batch = LoRABatch()
    layer = LoRALinear(float_layer(torch.randn(24, 16)), batch, num_slots=2, width=8, dtype=torch.float32,
                       device=torch.device("cpu"))
    layer.place(0, 0, torch.randn(4, 16), torch.randn(24, 4))
    layer.place(1, 8, torch.randn(2, 16), torch.randn(8, 2))
    x = torch.randn(6, 16)  # requests of 1, 3 and 2 tokens: slot 1, none, slot 0
    batch.rows, batch.groups = torch.tensor([4, 5, 0]), [(0, 0, 2), (1, 2, 3)]
    grouped = layer(x)
    batch.rows, batch.groups = None, []
    batch.segments = (torch.tensor([0, 1, 4, 6], dtype=torch.int32), torch.tensor([1, -1, 0], dtype=torch.int32))
    torch.testing.assert_close(layer(x), grouped)
