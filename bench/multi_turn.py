"""``workload.multi_turn``: chats whose every turn resends the conversation so far."""

from __future__ import annotations

import random
from typing import Any

from servelab.bench.lengths import check_range, sample_lengths, uniform_length
from servelab.bench.prompts import PromptSource
from servelab.bench.sessions import Turn, check_delay, draw_delay
from servelab.bench.workload import TokenSpace
from servelab.core.errors import ConfigError


def multi_turn_turns(cfg: Any, space: TokenSpace, source: PromptSource, seed: str) -> list[list[Turn]]:
    """The turns of ``cfg.multi_turn.conversations`` chats: a turn count uniform over
    ``turns``, each turn a new user message and an output whose lengths are drawn from the
    workload's ``lengths``, each later turn sent a think time after the previous answer."""
    chat = cfg.multi_turn
    problems = check_delay(chat.think_time, chat.think_time_s, "multi_turn.think_time")
    if chat.conversations < 1:
        problems.append(f"workload.multi_turn.conversations must be >= 1, got {chat.conversations}")
    problems += check_range(chat.turns, "multi_turn.turns")
    if problems:
        raise ConfigError(problems)
    count_rng = random.Random(f"{seed}:turns")
    counts = [uniform_length(chat.turns, "multi_turn.turns", count_rng) for _ in range(chat.conversations)]
    pairs = iter(sample_lengths(cfg, space.max_model_len, random.Random(f"{seed}:lengths"), sum(counts)))
    think = random.Random(f"{seed}:think")
    return [[Turn(tuple(source.draw(message_len)), output_len, draw_delay(chat.think_time, chat.think_time_s, think))
             for message_len, output_len in (next(pairs) for _ in range(count))] for count in counts]
