"""``cache.kv_dtype``: the element type the KV cache stores (docs/quantization.md).

``auto`` stores keys and values in the model's dtype. ``int8`` and ``fp8_e4m3`` store
one byte per element plus a float32 scale per (token slot, KV head), written next to
the slot's D values by the cache-write path and applied inside every attention backend.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.core.errors import ConfigError

KV_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_BYTES = 4
"""A float32 scale follows the D quantized values of each (slot, KV head)."""


def quantized_kv_dtypes() -> tuple[torch.dtype, ...]:
    """The torch dtypes of a quantized cache that this torch has."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    return (torch.int8,) + ((fp8,) if fp8 is not None else ())


def is_quantized(dtype: torch.dtype) -> bool:
    """True for a one-byte cache dtype that carries scales (int8, float8_e4m3fn)."""
    return dtype in quantized_kv_dtypes()


def kv_dtype_name(cache_config: Any) -> str:
    """The ``kv_dtype`` a cache config asks for (``auto`` for caches without the option)."""
    return getattr(cache_config, "kv_dtype", "auto") or "auto"


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of ``cache.kv_dtype=name`` for a model computing in ``model_dtype``;
    raises ``ConfigError`` naming the field for an unknown value or a missing torch dtype."""
    if name not in KV_DTYPES:
        raise ConfigError([f"cache.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}"])
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise ConfigError([f"cache.kv_dtype=fp8_e4m3 needs torch.float8_e4m3fn, which torch {torch.__version__} "
                           "lacks; use cache.kv_dtype=int8"])
    return fp8

