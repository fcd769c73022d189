"""``cache_salt``: prefix caching reuses a block only for requests of the same salt."""

from __future__ import annotations

import pytest

from servelab import LLM, InvalidRequestError, SamplingParams
from servelab.testing.oracle import assert_no_leaked_blocks

PROMPT = list(range(3, 40))


def run(llm: LLM, salt: str | None) -> tuple[list[int], int]:
    """Generate for PROMPT under ``salt``: (tokens, prefix-hit tokens of that request)."""
    engine = llm.engine
    before = engine.cache.prefix_hit_tokens
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=3), cache_salt=salt)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return list(finished[0].outputs[0].token_ids), engine.cache.prefix_hit_tokens - before


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_prefixes_are_shared_within_a_salt_only(index):
    llm = LLM("toy", overrides=["cache.block_size=4", "cache.enable_prefix_caching=true",
                                f"cache.prefix_index={index}"])
    plain, first_hit = run(llm, None)
    assert first_hit == 0
    assert run(llm, "tenant-a") == (plain, 0)
    tokens, hit = run(llm, "tenant-a")
    assert tokens == plain and hit == 36
    assert run(llm, "tenant-b") == (plain, 0)
    assert run(llm, None)[1] == 36
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_a_bad_cache_salt_is_refused_by_name(salt):
    llm = LLM("toy")
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=2), cache_salt=salt)
    assert not llm.engine.has_unfinished_requests()
