"""Save a quantized copy of a checkpoint, which servelab then loads without re-quantizing:

    python -m servelab.core.entrypoints.quantize --model checkpoints/tiny --out /tmp/tiny-int4 --quantization int4

The folder holds ``model.safetensors`` (every decoder linear weight ``<layer>.weight`` as
``<layer>.qweight`` / ``<layer>.scales`` (/ ``<layer>.zeros``) in the format of
``servelab/kernels/quantized_weights.py``, every other tensor as it was), the source's config.json
with a ``quantization_config`` entry (``{"quant_method": "servelab", "bits": 8 | 4,
"group_size": 128 | -1}``) and the source's other files (tokenizer, generation config).
``servelab model=local model.path=/tmp/tiny-int4`` serves it quantized (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

WEIGHT_FILE = "model.safetensors"


def is_weight_file(name: str) -> bool:
    """True for a checkpoint file that holds weights (what the saved folder replaces)."""
    return name.endswith((".safetensors", ".bin")) or name == "model.safetensors.index.json"


def save_quantized(model_path: str, out: str, quantization: str, group_size: int | None = None) -> str:
    """Quantize the floating-point Hugging Face folder ``model_path`` (``quantization``
    int8 | int4, int4 in groups of ``group_size`` input features, default 128) into the
    folder ``out``; returns ``out``. Raises ``ConfigError`` for a bad mode, group size or
    an already quantized source."""
    from servelab.core.checkpoint import load_checkpoint
    from servelab.core.config import ModelConfig
    from servelab.core.errors import ConfigError

    if quantization not in ("int8", "int4"):
        raise ConfigError([f"quantization must be int8 or int4, got {quantization!r}"])
    checkpoint = load_checkpoint(ModelConfig(path=model_path, quantization=quantization,
                                             quantization_group_size=group_size))
    if checkpoint.quantization.prequantized:
        raise ConfigError([f"{model_path} is quantized already; quantize its floating-point checkpoint"])
    tensors = {name: tensor.contiguous() for name, tensor in checkpoint.weights()}
    return write_quantized_folder(model_path, out, tensors, checkpoint.quantization.config_entry())


def write_quantized_folder(model_path: str, out: str, tensors: dict, quantization_config: dict) -> str:
    """Write ``tensors`` as the weights of the folder ``out``, a copy of the Hugging Face
    folder ``model_path``'s other files (tokenizer, generation config) and its
    ``config.json`` with ``quantization_config`` added; returns ``out``."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, WEIGHT_FILE), metadata={"format": "pt"})
    for name in sorted(os.listdir(model_path)):
        source = os.path.join(model_path, name)
        if name != "config.json" and os.path.isfile(source) and not is_weight_file(name):
            shutil.copyfile(source, os.path.join(out, name))
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return out


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--model``, ``--out``, ``--quantization``, ``--group-size``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a floating-point Hugging Face folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--quantization", required=True, choices=("int8", "int4"))
    parser.add_argument("--group-size", type=int, default=None, help="int4: input features per scale (128)")
    args = parser.parse_args(argv)
    print(save_quantized(args.model, args.out, args.quantization, args.group_size))


if __name__ == "__main__":
    main()
