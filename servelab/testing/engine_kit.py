"""What the engine-level kits share: tiny checkpoints, engines built with a component's
overrides, and a recorder of every step's schedule and result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import pytest

from servelab.testing.kit import ConformanceKit

ENGINE_BASE = ("model.dtype=float32", "device=cpu", "model.max_model_len=128")
"""Every kit engine: float32 on the CPU, sequences of at most 128 tokens."""


@dataclass
class StepLog:
    """Every ``SchedulerOutput`` an engine's scheduler produced, in order, and every
    ``ExecutedStep`` (output and result) its executor returned."""

    outputs: list[Any] = field(default_factory=list)
    executed: list[Any] = field(default_factory=list)


def record_steps(engine: Any) -> StepLog:
    """Wrap the engine's scheduler and executor so that every step is logged."""
    log = StepLog()
    schedule, collect = engine.scheduler.schedule, engine.executor.collect

    def logged_schedule():
        output = schedule()
        log.outputs.append(output)
        return output

    def logged_collect():
        executed = collect()
        log.executed.append(executed)
        return executed

    engine.scheduler.schedule = logged_schedule
    engine.executor.collect = logged_collect
    return log


def run_to_completion(engine: Any, max_steps: int = 20_000, between_steps: Any = None) -> list[Any]:
    """Step until nothing is unfinished; the finished outputs. Fails past ``max_steps``."""
    finished = []
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        if between_steps is not None:
            between_steps(step)
        finished += [o for o in engine.step() if o.finished]
    pytest.fail(f"requests still unfinished after {max_steps} steps")


class EngineKit(ConformanceKit):
    """A conformance kit whose tests run whole engines on tiny random checkpoints: a
    target (``kit_checkpoint``) and a draft sharing its tokenizer (``kit_draft``), with
    ``engine_base`` overrides."""

    family = "llama"
    engine_base: ClassVar[tuple[str, ...]] = ENGINE_BASE

    @pytest.fixture(scope="class")
    @classmethod
    def kit_checkpoint(cls, tmp_path_factory) -> str:
        """A tiny random checkpoint of ``family``, with a random EAGLE-style head beside it
        (``<target>-eagle``, where ``decoding=eagle`` looks for one)."""
        from servelab.testing.eagle_head import random_eagle_head
        from servelab.testing.oracle import tiny_checkpoint

        target = tiny_checkpoint(tmp_path_factory.mktemp("kit") / "target", cls.family)
        if cls.family == "llama":
            random_eagle_head(target)
        return target

    @pytest.fixture(scope="class")
    @classmethod
    def kit_draft(cls, tmp_path_factory) -> str:
        """Another tiny checkpoint with the target's tokenizer but other weights (a draft
        whose proposals are mostly rejected)."""
        from servelab.testing.oracle import tiny_checkpoint

        return tiny_checkpoint(tmp_path_factory.mktemp("kit") / "draft", cls.family, seed=321)

    def overrides_for(self, name: str, checkpoint: str, draft: str, *extra: str) -> list[str]:
        """Engine overrides selecting component ``name`` with what it needs."""
        return [*self.engine_base, *self.component_overrides(name, checkpoint, draft), *extra]

    def llm(self, name: str, checkpoint: str, draft: str, *extra: str) -> Any:
        """An ``LLM`` on ``checkpoint`` with component ``name`` selected."""
        from servelab import LLM

        return LLM(checkpoint, overrides=self.overrides_for(name, checkpoint, draft, *extra))

    @staticmethod
    def prompts(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
        """Random token-id prompts of these lengths."""
        from servelab.testing.oracle import mixed_prompts

        return mixed_prompts(vocab_size, lengths, seed)
