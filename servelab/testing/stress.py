"""A random stress of the engine: mixed requests, aborts and a cache small enough to
preempt often, checked for exceptions, unfinished requests and held blocks."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

import pytest

from servelab.core.request_metadata import RequestMetadata
from servelab.core.sampling_params import SamplingParams
from servelab.testing.engine_kit import EngineKit
from servelab.testing.oracle import assert_tiers_whole

STRESS_CACHE = ("cache=paged", "cache.block_size=4", "cache.num_blocks=48", "cache.enable_prefix_caching=true",
                "cache.swap_space_bytes=4000000")
"""48 blocks of 4 tokens with prefix caching and a host pool: preemption is frequent."""
STOP_STRINGS = ("\n", "e", "(", "  ")


@dataclass(frozen=True, slots=True)
class StressReport:
    """What a stress run did: requests added, finished and aborted, engine steps,
    preemptions, prefix-cache hit tokens, and the mix (``n > 1``, beam search, stop
    strings and logprobs requests)."""

    num_requests: int
    num_finished: int
    num_aborted: int
    num_steps: int
    num_preemptions: int
    prefix_hit_tokens: int
    num_parallel: int
    num_beam: int
    num_stop_strings: int
    num_logprobs: int


def random_params(rng: random.Random) -> SamplingParams:
    """One request's parameters from the mix: greedy or seeded sampling, ``n`` up to 3,
    beam search, stop strings, logprobs, min_tokens, penalties."""
    max_tokens = rng.randint(1, 24)
    if rng.random() < 0.1:
        width = rng.randint(1, 3)
        return SamplingParams(use_beam_search=True, temperature=0.0, n=rng.randint(1, width), best_of=width,
                              max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    sampled = rng.random() < 0.5
    return SamplingParams(
        n=rng.choice((1, 1, 2, 3)), temperature=0.8 if sampled else 0.0, top_p=rng.choice((1.0, 0.9)),
        seed=rng.randrange(1000) if sampled and rng.random() < 0.7 else None, max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.2 else 0,
        stop=[rng.choice(STOP_STRINGS)] if rng.random() < 0.2 else None,
        logprobs=rng.randint(0, 3) if rng.random() < 0.3 else None,
        repetition_penalty=1.2 if rng.random() < 0.1 else 1.0, ignore_eos=rng.random() < 0.3)


def random_metadata(rng: random.Random, slo_classes: Sequence[str], beam_search: bool) -> RequestMetadata:
    """One request's metadata from the mix: a priority in [-3, 3], one of three tenants or
    none and, except for beam search, often one of ``slo_classes`` and sometimes a
    deadline up to 5 seconds away."""
    return RequestMetadata(
        priority=rng.randint(-3, 3), tenant=rng.choice((None, "alice", "bob", "carol")),
        slo_class=rng.choice(slo_classes) if slo_classes and not beam_search and rng.random() < 0.7 else None,
        deadline=time.time() + rng.uniform(0.05, 5.0) if not beam_search and rng.random() < 0.2 else None)


def run_stress(overrides: Sequence[str], num_requests: int = 150, seed: int = 0, abort_rate: float = 0.05,
               progress: Any = None) -> StressReport:
    """Feed ``num_requests`` random requests (a few per step, a fifth of them sharing one
    of three prompt prefixes; each with random ``RequestMetadata`` over the engine's SLO
    classes) to an ``LLM`` built with ``overrides`` and abort a random one with
    probability ``abort_rate`` per step. Asserts that nothing raises, that every request
    not aborted finishes within its limits (or is refused by its policy with no tokens),
    and that afterwards no request is left and no block is held."""
    from servelab import LLM

    rng = random.Random(seed)
    metadata_rng = random.Random(seed + 1)
    llm = LLM(overrides=list(overrides))
    engine, beams = llm.engine, llm.beam_search
    vocab = engine.vocab_size - 1
    prefixes = [[rng.randrange(vocab) for _ in range(20)] for _ in range(3)]
    slo_classes = sorted(engine.slo_classes)
    params: dict[str, SamplingParams] = {}
    in_flight: list[str] = []
    finished, aborted = 0, 0
    preemptions, hits, steps = 0, 0, 0
    schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal preemptions, hits
        output = schedule()
        preemptions += len(output.preempted)
        hits += output.num_prefix_hit_tokens
        return output

    engine.scheduler.schedule = counting_schedule
    while len(params) < num_requests or in_flight:
        for _ in range(rng.randint(0, 3) if len(params) < num_requests else 0):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
            if rng.random() < 0.2:
                prompt = rng.choice(prefixes) + prompt[:30]
            request_params = random_params(rng)
            metadata = random_metadata(metadata_rng, slo_classes, request_params.use_beam_search)
            request_id = (beams.add(prompt, request_params, metadata=metadata) if request_params.use_beam_search
                          else engine.add_request(prompt, request_params, metadata=metadata))
            params[request_id] = request_params
            in_flight.append(request_id)
        if in_flight and rng.random() < abort_rate:
            victim = in_flight.pop(rng.randrange(len(in_flight)))
            beams.abort([victim])
            aborted += 1
            if progress is not None:
                progress.update(1)
        for output in beams.process(engine.step()):
            if not output.finished:
                continue
            check_finished(output, params[output.request_id])
            in_flight.remove(output.request_id)
            finished += 1
            if progress is not None:
                progress.update(1)
        steps += 1
        assert steps < 100 * num_requests, "the engine stopped making progress"
    assert not engine.has_unfinished_requests() and not beams.groups
    usage = engine.cache.usage
    assert usage.used_blocks == 0 and usage.reserved_slots == 0, f"blocks held after the run: {usage}"
    assert_tiers_whole(llm)
    mix = list(params.values())
    return StressReport(len(params), finished, aborted, steps, preemptions, hits,
                        sum(p.n > 1 and not p.use_beam_search for p in mix), sum(p.use_beam_search for p in mix),
                        sum(bool(p.stop_strings) for p in mix), sum(p.logprobs is not None for p in mix))


def check_finished(output: Any, params: SamplingParams) -> None:
    """A finished output has ``n`` completions, each within ``max_tokens`` and with a
    reason, or refused by the policy (reason ``deadline``) with no tokens."""
    assert len(output.outputs) == params.n, (output.request_id, len(output.outputs), params)
    for completion in output.outputs:
        if completion.finish_reason == "deadline":
            assert not completion.token_ids, completion
            continue
        assert completion.finish_reason in ("stop", "length"), completion
        assert 1 <= len(completion.token_ids) <= params.max_tokens, (len(completion.token_ids), params)
        if params.logprobs is not None and not params.use_beam_search:
            assert len(completion.logprobs) == len(completion.token_ids)


class StressConformance(EngineKit):
    """Every scheduler (or the ``names`` listed) under ``run_stress`` with preemption by
    recompute and by swap, on a tiny checkpoint with a 48-block paged cache: no
    exception, every request ends, no block held afterwards. ``num_requests`` and
    ``seed`` fix the run."""

    kind = "scheduler"
    num_requests = 60
    seed = 0

    @pytest.mark.parametrize("mode", ["recompute", "swap"])
    def test_random_mix_never_breaks(self, component, mode, kit_checkpoint, kit_draft):
        from hydra.errors import ConfigCompositionException

        overrides = ["model=local", f"model.path={kit_checkpoint}",
                     *self.overrides_for(component, kit_checkpoint, kit_draft, *STRESS_CACHE,
                                         f"scheduler.preemption={mode}")]
        try:
            report = run_stress(overrides, self.num_requests, self.seed)
        except ConfigCompositionException as exc:
            pytest.skip(f"scheduler={component} cannot take scheduler.preemption={mode}: {exc}")
        assert report.num_finished + report.num_aborted == report.num_requests
        assert report.num_preemptions > 0, f"the stress never preempted: {report}"

