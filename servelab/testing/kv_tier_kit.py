"""Conformance kit for KV tiers below the host (``cache.lower_tier``): the ``KVTier``
contract on its own, and whole engines whose greedy output does not depend on the tier."""

from __future__ import annotations

from typing import Any, ClassVar

from servelab.testing.kit import ConformanceKit

BLOCK_BYTES = 96


class KVTierConformance(ConformanceKit):
    """The ``KVTier`` contract: a saved block loads back byte for byte; a block never
    saved, discarded, or asked for with other tokens or parent is a miss; a ``persistent``
    tier reopened on the same ``location`` lists what was saved, oldest first, and loads
    it. Through an engine (a 40-block device cache, a tiny host tier, the tier below it):
    greedy output equal to one without prefix caching, prefixes served from the tier
    (again after a restart when ``persistent``), every host block back afterwards, and a
    stress run with aborts under both preemption modes holding no block. ``location``
    gives the tier's ``cache.lower_tier_path`` for a test's temporary folder."""

    kind = "kv_tier"
    persistent: ClassVar[bool] = True

    def location(self, component: str, tmp_path: Any) -> str:
        """Where the tier keeps blocks in a test (default: a temporary folder)."""
        return str(tmp_path / component)

    def _open(self, component: str, tmp_path: Any, capacity_blocks: int = 8):
        from servelab.core.engine.registry import get_registry
        from servelab.core.kv_tier import KVTierContext

        context = KVTierContext(self.location(component, tmp_path), capacity_blocks * BLOCK_BYTES, BLOCK_BYTES,
                                "kit")
        return get_registry().get("kv_tier", component).cls(context)

    def test_saved_blocks_load_back_and_others_miss(self, component, tmp_path):
        import torch

        from servelab.core.kv_tier import TierEntry

        tier = self._open(component, tmp_path)
        first, second = TierEntry(11, None, (1, 2, 3, 4)), TierEntry(-12, 11, (5, 6, 7, 8))
        payloads = {entry: torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8) for entry in (first, second)}
        for entry, payload in payloads.items():
            assert tier.save(entry, payload.clone())
        out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        for entry, payload in payloads.items():
            assert tier.load(entry, out) and torch.equal(out, payload)
        assert not tier.load(TierEntry(11, None, (1, 2, 3, 9)), out), "a block asked for with other tokens loaded"
        assert not tier.load(TierEntry(11, 7, (1, 2, 3, 4)), out), "a block asked for with another parent loaded"
        assert not tier.load(TierEntry(13, None, (1, 2, 3, 4)), out), "a block never saved loaded"
        tier.discard(first.digest)
        assert not tier.load(first, out), "a discarded block loaded"
        tier.close()
        if self.persistent:
            reopened = self._open(component, tmp_path)
            assert reopened.stored() == [second]
            assert reopened.load(second, out) and torch.equal(out, payloads[second])
            reopened.close()

    @staticmethod
    def tier_overrides(component: str, location: str) -> list[str]:
        """Prefix caching, a host tier of a few blocks and ``component`` below it at ``location``."""
        return ["cache.enable_prefix_caching=true", "cache.host_cache_bytes=20000", f"cache.lower_tier={component}",
                "cache.lower_tier_bytes=4000000", f"cache.lower_tier_path={location}"]

    def _engine(self, component: str, tmp_path: Any) -> list[str]:
        return ["model.max_model_len=128", "cache.block_size=4", "cache.num_blocks=40", "scheduler.max_num_seqs=1",
                *self.tier_overrides(component, self.location(component, tmp_path))]

    def test_greedy_output_is_the_same_through_the_tier(self, component, tmp_path):
        from servelab import LLM, SamplingParams
        from servelab.testing.oracle import assert_no_leaked_blocks, assert_tiers_whole, hot_prefix_prompts

        params = SamplingParams(temperature=0.0, max_tokens=4)
        prompts = hot_prefix_prompts(rounds=3)
        plain = LLM("toy", overrides=["model.max_model_len=128", "cache.block_size=4"])
        expected = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        plain.engine.shutdown()
        for run in range(2 if self.persistent else 1):
            llm = LLM("toy", overrides=self._engine(component, tmp_path))
            got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
            assert got == expected, f"run {run}"
            lower = llm.engine.cache.lower
            assert lower.index.hit_tokens > 0, f"run {run}: no prefix came from the tier"
            assert run == 0 or lower.warm_blocks > 0, "a restarted engine found none of the blocks saved before"
            assert_no_leaked_blocks(llm)
            assert_tiers_whole(llm)
            llm.engine.shutdown()

    def test_stress_with_aborts_holds_no_block(self, component, tmp_path):
        from servelab.testing.stress import STRESS_CACHE, run_stress

        for mode in ("recompute", "swap"):
            tier = self.tier_overrides(component, f"{self.location(component, tmp_path)}-{mode}")
            report = run_stress(["model=toy", "model.max_model_len=128", *STRESS_CACHE, *tier,
                                 f"scheduler.preemption={mode}"], num_requests=40, seed=3)
            assert report.num_finished + report.num_aborted == report.num_requests
