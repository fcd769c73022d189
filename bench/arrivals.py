"""When requests arrive: all at once, Poisson, or gamma with a burstiness factor."""

from __future__ import annotations

import random

from servelab.core.errors import ConfigError

ARRIVALS = ("all_at_once", "poisson", "gamma", "trace")


def arrival_offsets(kind: str, num_requests: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Arrival times in seconds after the start, non-decreasing, the first at 0.

    ``poisson``: exponential gaps of mean ``1 / rate``. ``gamma``: gamma gaps of shape
    ``burstiness`` and the same mean (coefficient of variation ``1 / sqrt(burstiness)``;
    shape 1 is Poisson). ``all_at_once``: every request at 0 (offline throughput).
    """
    if kind not in ARRIVALS or kind == "trace":
        raise ConfigError([f"workload.arrival must be one of {', '.join(ARRIVALS)}, got {kind!r}"])
    if kind == "all_at_once":
        return [0.0] * num_requests
    if rate <= 0:
        raise ConfigError([f"workload.rate must be > 0 requests/s for arrival={kind}, got {rate}"])
    shape = 1.0 if kind == "poisson" else burstiness
    if shape <= 0:
        raise ConfigError([f"workload.burstiness must be > 0, got {burstiness}"])
    scale = 1.0 / (rate * shape)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.gammavariate(shape, scale)
    return offsets
