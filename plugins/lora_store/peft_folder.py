"""A PEFT adapter folder on disk: ``adapter_config.json`` and ``adapter_model.safetensors``
(or ``adapter_model.bin``), read as a ``StoredAdapter``; what both built-in stores read."""

from __future__ import annotations

import json
import os

import torch

from servelab.core.errors import InvalidRequestError
from servelab.core.lora_store import StoredAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def is_peft_folder(path: str) -> bool:
    """True when ``path`` is a folder with an ``adapter_config.json``."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise InvalidRequestError("lora_path", f"{path!r} is not a folder")
    if not os.path.isfile(config_file):
        raise InvalidRequestError("lora_path", f"{path!r} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    try:
        with open(config_file) as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError("lora_path", f"{config_file} is not valid JSON: {exc}") from exc


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        weight_file = os.path.join(path, file_name)
        if not os.path.isfile(weight_file):
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                tensors = load_file(weight_file)
            else:
                tensors = torch.load(weight_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: say which
            raise InvalidRequestError("lora_path", f"cannot read {weight_file}: {exc}") from exc
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise InvalidRequestError("lora_path", f"{weight_file} does not hold a dictionary of tensors")
        return tensors
    raise InvalidRequestError("lora_path", f"{path!r} is not a PEFT adapter folder: it has none of "
                                           f"{', '.join(WEIGHT_FILES)}")


def read_peft_folder(path: str) -> StoredAdapter:
    """The adapter in folder ``path`` (its absolute path as the source);
    ``InvalidRequestError`` naming ``lora_path`` for a folder that is not a PEFT adapter
    or files that cannot be read."""
    return StoredAdapter(os.path.abspath(path), _read_config(path), _read_tensors(path))
