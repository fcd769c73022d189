"""The plugin passes every servelab conformance kit and orders admissions by prompt length."""

from __future__ import annotations

from servelab import LLM, SamplingParams
from servelab.testing import (EntryPointConformance, PolicyConformance, SchedulerConformance, StressConformance,
                              assert_engine_matches_transformers, tiny_checkpoint)


class TestSchedulerContract(SchedulerConformance): names = ("shortest_prompt_first",)


class TestStress(StressConformance): names = ("shortest_prompt_first",)


class TestEntryPoints(EntryPointConformance): names = ("scheduler=shortest_prompt_first",)


class TestPolicies(PolicyConformance): schedulers = ("shortest_prompt_first",)  # every policy over this scheduler


def test_matches_transformers(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    assert_engine_matches_transformers(folder, ["scheduler=shortest_prompt_first"])


def test_shortest_prompt_finishes_first(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(folder, scheduler="shortest_prompt_first", overrides=["scheduler.max_num_seqs=1"])
    engine = llm.engine
    for length in (30, 5, 12):
        engine.add_request([7] * length, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        order += [len(o.prompt_token_ids) for o in engine.step() if o.finished]
    assert order == [5, 12, 30]
