"""The W8A8 compressed-tensors copy that vLLM's CPU backend reads for the quantized
comparison: the same int8 weights as servelab's ``w8a8``, in the layout that format names."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from servelab.bench.compressed_tensors import write_w8a8_checkpoint
from servelab.kernels.quantized_weights import quantize_int8


def test_the_copy_holds_servelabs_int8_weights_and_the_format_config(llama, tmp_path):
    folder = write_w8a8_checkpoint(llama, str(tmp_path / "w8a8"))
    source = load_file(os.path.join(llama, "model.safetensors"))
    copy = load_file(os.path.join(folder, "model.safetensors"))
    linear = [name for name in source if name.endswith(("q_proj.weight", "down_proj.weight", "gate_proj.weight"))]
    assert linear
    for name in linear:
        qweight, scales = quantize_int8(source[name])
        assert copy[name].dtype == torch.int8 and torch.equal(copy[name], qweight)
        assert copy[name + "_scale"].shape == (source[name].shape[0], 1)
        assert torch.equal(copy[name + "_scale"][:, 0], scales)
    untouched = [name for name in source if "norm" in name or "embed" in name]
    assert untouched and all(torch.equal(copy[name], source[name]) for name in untouched)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    group = config["quantization_config"]["config_groups"]["group_0"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    assert os.path.exists(os.path.join(folder, "tokenizer_config.json"))
    assert write_w8a8_checkpoint(llama, folder) == folder                     # kept, not rewritten
