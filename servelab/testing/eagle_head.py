"""A random EAGLE-style head for a test checkpoint (``decoding=eagle``'s folder format)."""

from __future__ import annotations

import json
import os

HEAD_KEYS = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act")


def random_eagle_head(target: str, folder: str | None = None, seed: int = 0, **overrides) -> str:
    """Write a random head for the Llama checkpoint in ``target`` to ``folder``
    (default ``<target>-eagle``, where ``decoding=eagle`` looks); ``overrides`` change
    config fields (a wrong ``hidden_size`` makes a head the strategy refuses). Returns the folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    folder = folder or f"{os.path.normpath(target)}-eagle"
    target_config = AutoConfig.from_pretrained(target)
    config = {key: getattr(target_config, key) for key in HEAD_KEYS if getattr(target_config, key, None) is not None}
    config["rope_theta"] = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    config.update(overrides)
    torch.manual_seed(seed)
    layer = LlamaForCausalLM(LlamaConfig(**config, num_hidden_layers=1))
    weights = {name: tensor.contiguous() for name, tensor in layer.state_dict().items()
               if name.startswith(("model.layers.0.", "model.norm."))}
    weights["fc.weight"] = torch.randn(config["hidden_size"], 2 * config["hidden_size"]) * 0.05
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as out:
        json.dump({"architectures": ["EagleHead"], "model_type": "eagle_head", "num_hidden_layers": 1, **config}, out)
    return folder
