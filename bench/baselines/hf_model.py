"""The configured checkpoint as a Hugging Face transformers model (for the baselines)."""

from __future__ import annotations

from typing import Any


def load_hf_model(model_cfg: Any, device_name: str) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a transformers ``AutoModelForCausalLM`` with the weights
    servelab would serve for ``model_cfg`` (a Hugging Face folder or the in-memory toy
    model), in servelab's dtype for that device, in eval mode."""
    from transformers import AutoModelForCausalLM

    from servelab.core.checkpoint import load_checkpoint, resolve_device, resolve_dtype

    from servelab.core.errors import ConfigError

    checkpoint = load_checkpoint(model_cfg)
    if checkpoint.weights is None:
        raise ConfigError([f"the model is a shape without weights ({checkpoint.architecture}); a baseline needs "
                           f"weights: pick a checkpoint or model=toy"])
    if checkpoint.quantization is not None:
        raise ConfigError([f"model.quantization={checkpoint.quantization.mode}: the transformers baseline runs "
                           f"floating-point checkpoints only"])
    device = resolve_device(device_name)
    dtype = resolve_dtype(model_cfg.dtype, checkpoint.hf_config, device)
    if model_cfg.shape is None:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(checkpoint.hf_config, dtype=dtype)
        model.load_state_dict(dict(checkpoint.weights()))
    return model.to(device).eval(), checkpoint.tokenizer


def save_hf_folder(model_cfg: Any, folder: str) -> str:
    """Write the configured model and tokenizer as a Hugging Face folder (for engines that
    load only from disk); returns ``folder``."""
    model, tokenizer = load_hf_model(model_cfg, "cpu")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
