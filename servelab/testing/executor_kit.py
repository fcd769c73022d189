"""Conformance kit for executors: what ``shutdown`` and garbage collection release, on
whole engines."""

from __future__ import annotations

import gc
import weakref
from typing import ClassVar

import pytest

from servelab.core.sampling_params import SamplingParams
from servelab.testing.engine_kit import EngineKit
from servelab.testing.lifecycle import ProcessResources, assert_released, reachable_tensor_bytes

RELEASED_TENSOR_BYTES = 1 << 20
"""What an executor may still reach in tensors after ``shutdown`` (its model and KV
tensors are gone; small constants may stay)."""


class ExecutorConformance(EngineKit):
    """The ``Executor`` lifecycle, for every ``layouts`` entry (the overrides of one
    device, and of two tensor-parallel ranks): after ``LLM.shutdown`` no child process,
    thread or process group is left, the torch thread count is back, the executor reaches
    no model or KV tensors, a second ``shutdown`` does nothing and ``generate`` raises
    ``EngineShutdownError``; dropping the last reference to an unshut ``LLM`` releases
    the same. An executor that cannot run a layout lists the ones it can in ``layouts``."""

    kind = "executor"
    layouts: ClassVar[tuple[tuple[str, ...], ...]] = ((), ("parallel.tensor_parallel_size=2",))

    def pytest_generate_tests(self, metafunc) -> None:
        """Parametrize ``component`` over the kit's names and ``layout`` over ``layouts``."""
        super().pytest_generate_tests(metafunc)
        if "layout" in metafunc.fixturenames:
            metafunc.parametrize("layout", self.layouts, ids=[" ".join(o) or "one-device" for o in self.layouts])

    @pytest.fixture(scope="class")
    @classmethod
    def warm_process(cls, kit_checkpoint, kit_draft) -> None:
        """One engine run and shut down first, so the process-wide thread pools of torch
        and the tokenizer exist before any snapshot."""
        kit = cls()
        llm = kit.llm("model", kit_checkpoint, kit_draft)
        kit._generate(llm)
        llm.shutdown()

    def _generate(self, llm) -> None:
        prompts = self.prompts(llm.engine.vocab_size, (5, 12))
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]

    def test_shutdown_releases_everything(self, component, layout, kit_checkpoint, kit_draft, warm_process):
        from servelab.core.errors import EngineShutdownError

        before = ProcessResources.now()
        llm = self.llm(component, kit_checkpoint, kit_draft, *layout)
        self._generate(llm)
        executor = llm.engine.executor
        llm.shutdown()
        assert_released(before)
        assert reachable_tensor_bytes(executor) <= RELEASED_TENSOR_BYTES, (
            f"executor={component} still reaches {reachable_tensor_bytes(executor)} bytes of tensors after shutdown")
        llm.shutdown()
        executor.shutdown()
        with pytest.raises(EngineShutdownError, match="generate: this engine has been shut down"):
            llm.generate([[1, 2, 3]])

    def test_dropping_the_last_reference_releases_everything(self, component, layout, kit_checkpoint, kit_draft,
                                                            warm_process):
        before = ProcessResources.now()
        llm = self.llm(component, kit_checkpoint, kit_draft, *layout)
        self._generate(llm)
        engine = weakref.ref(llm.engine)
        del llm
        gc.collect()
        assert engine() is None, f"executor={component}: something still holds the engine: {gc.get_referrers(engine())}"
        assert_released(before)
