"""Which LoRA adapter each request of a workload runs with: the adapters' names and how
popular each is (``workload.adapter_popularity``).

- ``uniform``: every adapter equally likely.
- ``zipf``: adapter i (from 0) weighs (i + 1)^-alpha (``workload.adapter_alpha``).
- ``power``: S-LoRA's synthetic traces (Sheng et al., MLSys 2024): the adapter index is
  floor(n x), x drawn from the power distribution of density alpha x^(alpha - 1) on
  [0, 1] (numpy's ``random.power``): alpha = 1 is uniform, a smaller alpha sends more
  requests to the first adapters.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable

from servelab.core.errors import ConfigError

POPULARITY = ("uniform", "zipf", "power")
"""The values of ``workload.adapter_popularity``."""


def adapter_names(cfg: Any) -> list[str]:
    """The workload's adapters: ``adapters`` when it lists any, else ``num_adapters``
    names ``adapter0`` ... (empty: every request runs on the base model)."""
    listed = list(getattr(cfg, "adapters", None) or ())
    count = getattr(cfg, "num_adapters", 0) or 0
    if listed and count:
        raise ConfigError([f"workload.adapters and workload.num_adapters={count} both name adapters: give one"])
    if count < 0:
        raise ConfigError([f"workload.num_adapters must be >= 0, got {count}"])
    return listed or [f"adapter{i}" for i in range(count)]


def adapter_draw(cfg: Any, names: list[str], draws: random.Random) -> Callable[[], str | None]:
    """A function giving each next request's adapter (None without adapters), drawn from
    ``draws`` by the workload's popularity (module docstring)."""
    if not names:
        return lambda: None
    popularity = getattr(cfg, "adapter_popularity", "uniform")
    alpha = float(getattr(cfg, "adapter_alpha", 1.0))
    if popularity not in POPULARITY:
        raise ConfigError([f"workload.adapter_popularity must be one of {', '.join(POPULARITY)}, got {popularity!r}"])
    if popularity == "uniform":
        return lambda: draws.choice(names)
    if alpha <= 0 if popularity == "power" else alpha < 0:
        raise ConfigError([f"workload.adapter_alpha must be {'> 0' if popularity == 'power' else '>= 0'} for "
                           f"adapter_popularity={popularity}, got {alpha}"])
    if popularity == "zipf":
        weights = list(itertools.accumulate((i + 1) ** -alpha for i in range(len(names))))
        return lambda: draws.choices(names, cum_weights=weights)[0]
    return lambda: names[min(int(len(names) * draws.random() ** (1.0 / alpha)), len(names) - 1)]
