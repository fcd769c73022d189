"""``workload.agentic``: agent loops of short model calls over a growing shared context."""

from __future__ import annotations

import random
from typing import Any

from servelab.bench.lengths import check_range, uniform_length
from servelab.bench.prompts import PromptSource
from servelab.bench.sessions import Turn, check_delay, draw_delay
from servelab.bench.workload import TokenSpace
from servelab.core.errors import ConfigError


def agentic_turns(cfg: Any, space: TokenSpace, source: PromptSource, seed: str) -> list[list[Turn]]:
    """The calls of ``cfg.agentic.sessions`` agent loops: a call count uniform over
    ``steps``; the first call's message is the session's document, each later one a tool
    result sent a tool latency after the previous call's output; every call outputs
    ``call_output_len`` tokens (the tool call)."""
    agent = cfg.agentic
    problems = check_delay(agent.tool_latency, agent.tool_latency_s, "agentic.tool_latency")
    if agent.sessions < 1:
        problems.append(f"workload.agentic.sessions must be >= 1, got {agent.sessions}")
    for name in ("steps", "document_len", "call_output_len", "tool_result_len"):
        problems += check_range(getattr(agent, name), f"agentic.{name}")
    if problems:
        raise ConfigError(problems)
    rng = random.Random(f"{seed}:lengths")
    latency = random.Random(f"{seed}:think")
    sessions = []
    for _ in range(agent.sessions):
        steps = uniform_length(agent.steps, "agentic.steps", rng)
        messages = [uniform_length(agent.document_len, "agentic.document_len", rng)]
        messages += [uniform_length(agent.tool_result_len, "agentic.tool_result_len", rng) for _ in range(steps - 1)]
        sessions.append([Turn(tuple(source.draw(length)),
                              uniform_length(agent.call_output_len, "agentic.call_output_len", rng),
                              draw_delay(agent.tool_latency, agent.tool_latency_s, latency)) for length in messages])
    return sessions
