"""Saving a trained model as a Hugging Face folder, and reading it back."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .tokenizer import EOT, save_tokenizer


def save_checkpoint(model, tokenizer, folder: Path) -> None:
    """Save a copy of ``model`` as bfloat16 safetensors with its tokenizer and a greedy
    generation config (``model`` itself stays float32)."""
    folder.mkdir(parents=True, exist_ok=True)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy = copy.to(torch.bfloat16)
    copy.config.dtype = torch.bfloat16
    copy.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False)
    copy.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)


def load_float32(folder: Path):
    """The checkpoint in ``folder`` loaded by transformers' Auto class, computing in float32
    (as servelab runs it on CPU)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy_sample(folder: Path, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy completion of ``prompt`` by the checkpoint in ``folder`` (transformers, float32)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_float32(folder)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def folder_bytes(folder: Path) -> int:
    """Total size in bytes of the files in ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
