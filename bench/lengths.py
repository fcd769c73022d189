"""How long prompts and outputs are: fixed, uniform, ShareGPT-like, long-prompt."""

from __future__ import annotations

import math
import random

from servelab.core.errors import ConfigError

LENGTHS = ("fixed", "uniform", "sharegpt", "long_prompt", "trace")


def check_range(bounds, name: str) -> list[str]:
    """Problems of the inclusive ``[low, high]`` range ``workload.<name>`` (1 <= low <= high)."""
    if len(bounds) != 2 or not 1 <= int(bounds[0]) <= int(bounds[1]):
        return [f"workload.{name} must be [low, high] with 1 <= low <= high, got {list(bounds)}"]
    return []


def uniform_length(bounds, name: str, rng: random.Random) -> int:
    """A length uniform over the inclusive range ``bounds`` of the field ``workload.<name>``;
    ``ConfigError`` naming it unless 1 <= low <= high."""
    problems = check_range(bounds, name)
    if problems:
        raise ConfigError(problems)
    return rng.randint(int(bounds[0]), int(bounds[1]))


def lognormal_length(mean: float, sigma: float, rng: random.Random) -> int:
    """A lognormal sample with the given mean (mu = ln(mean) - sigma^2 / 2), at least 1."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def sample_lengths(cfg, max_model_len: int, rng: random.Random, count: int | None = None) -> list[tuple[int, int]]:
    """``count`` (default ``cfg.num_requests``) (prompt tokens, output tokens) pairs drawn
    from ``cfg.lengths``, before the shared prefix is added and before clamping."""
    kind = cfg.lengths
    if kind not in LENGTHS or kind == "trace":
        raise ConfigError([f"workload.lengths must be one of {', '.join(LENGTHS)}, got {kind!r}"])
    if kind == "fixed" and (cfg.input_len < 1 or cfg.output_len < 1):
        raise ConfigError([f"workload.input_len and workload.output_len must be >= 1, got {cfg.input_len}, {cfg.output_len}"])
    if kind == "long_prompt" and not 0 < cfg.long_prompt_fraction[0] <= cfg.long_prompt_fraction[1] <= 1:
        raise ConfigError([f"workload.long_prompt_fraction must be [low, high] in (0, 1], "
                           f"got {list(cfg.long_prompt_fraction)}"])
    pairs = []
    for _ in range(cfg.num_requests if count is None else count):
        if kind == "fixed":
            pair = (cfg.input_len, cfg.output_len)
        elif kind == "uniform":
            pair = (uniform_length(cfg.input_range, "input_range", rng), uniform_length(cfg.output_range, "output_range", rng))
        elif kind == "sharegpt":
            pair = (lognormal_length(cfg.sharegpt.input_mean, cfg.sharegpt.sigma, rng),
                    lognormal_length(cfg.sharegpt.output_mean, cfg.sharegpt.sigma, rng))
        else:
            low, high = cfg.long_prompt_fraction
            pair = (max(1, int(rng.uniform(low, high) * max_model_len)), uniform_length(cfg.output_range, "output_range", rng))
        pairs.append(pair)
    return pairs


def clamp_lengths(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Fit one request into the context: the output keeps at most half of it, the prompt
    is cut to the rest, so prompt + output <= ``max_model_len``."""
    output_len = max(1, min(output_len, max_model_len // 2))
    return max(1, min(prompt_len, max_model_len - output_len)), output_len
