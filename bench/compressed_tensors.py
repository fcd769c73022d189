"""A W8A8 int8 copy of a float checkpoint in the compressed-tensors layout, the format in
which vLLM's CPU backend runs int8 weights with int8 activations (``benchmarks/compare_vllm.py
--vllm-quantization w8a8``): the reference for servelab's ``model.quantization=w8a8``.

Every decoder linear weight becomes int8 with one float32 scale per output channel
(servelab's own ``quantize_int8``: the same weights its ``w8a8`` computes at load), stored as ``<name>.weight`` and ``<name>.weight_scale`` (shape ``[out, 1]``);
activations are quantized at run time with one scale per token. The embedding, the norms
and the LM head stay as they are.
"""

from __future__ import annotations

import os

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        },
    },
}
"""``config.json``'s ``quantization_config``: int8 per-channel weights, dynamic per-token int8
activations, every ``Linear`` except the LM head."""


def is_quantized_linear(name: str) -> bool:
    """Whether the tensor ``name`` is a decoder linear weight that the copy stores in int8."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_SUFFIXES


def write_w8a8_checkpoint(source: str, folder: str) -> str:
    """Write the int8 copy of the safetensors checkpoint in ``source`` into ``folder`` (kept if
    it already holds one) and return ``folder``."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    from safetensors.torch import load_file

    from servelab.core.entrypoints.quantize import WEIGHT_FILE, write_quantized_folder
    from servelab.kernels.quantized_weights import quantize_int8

    tensors = {}
    for name, tensor in load_file(os.path.join(source, WEIGHT_FILE)).items():
        if not is_quantized_linear(name):
            tensors[name] = tensor
            continue
        tensors[name], scales = quantize_int8(tensor)
        tensors[name + "_scale"] = scales[:, None]
    return write_quantized_folder(source, folder, tensors, QUANTIZATION_CONFIG)
