"""Scheduling policies: VTC's fairness bound, priority preemption, deadline refusals, and
request metadata errors that name the field."""

from __future__ import annotations

import random
import time

import pytest

from servelab import LLM, InvalidRequestError, RequestMetadata, SamplingParams
from servelab.core.errors import ConfigError
from servelab.core.request import RequestStatus

SIMULATED = ["executor=simulated", "model.max_model_len=512", "scheduler.max_num_seqs=8",
             "scheduler.max_num_batched_tokens=2048"]
INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0


def captured_requests(engine) -> list:
    """Every request the scheduler is handed, in order."""
    requests = []
    add = engine.scheduler.add_request

    def capture(request):
        requests.append(request)
        add(request)

    engine.scheduler.add_request = capture
    return requests


def largest_service_gap(policy_overrides: list[str], seed: int) -> tuple[float, float]:
    """Two tenants backlogged from the start, one with long requests queued first; the
    largest difference of the weighted service (prompt tokens once scheduled, twice each
    output token) they received while both still had requests waiting, and the paper's
    bound 2 * (w_p * L_input + w_q * M), M the tokens a batch can hold."""
    rng = random.Random(seed)
    llm = LLM("toy", overrides=[*SIMULATED, *policy_overrides])
    engine = llm.engine
    requests = captured_requests(engine)
    longest = 0
    for tenant, prompt_range, output_range in (("heavy", (200, 400), (60, 120)), ("light", (10, 60), (5, 30))):
        for _ in range(40):
            prompt = [rng.randrange(1, 200) for _ in range(rng.randint(*prompt_range))]
            longest = max(longest, len(prompt))
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(*output_range), ignore_eos=True),
                               metadata=RequestMetadata(tenant=tenant))
    gap = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        waiting = {r.metadata.tenant for r in requests if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)}
        if waiting != {"heavy", "light"}:
            break
        service = {"heavy": 0.0, "light": 0.0}
        for r in requests:
            if r.first_scheduled_time is not None:
                service[r.metadata.tenant] += INPUT_WEIGHT * r.num_prompt_tokens + OUTPUT_WEIGHT * r.num_output_tokens
        gap = max(gap, abs(service["heavy"] - service["light"]))
    batch_tokens = 8 * 512
    return gap, 2 * (INPUT_WEIGHT * longest + OUTPUT_WEIGHT * batch_tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vtc_bounds_the_service_gap_between_backlogged_tenants(seed):
    gap, bound = largest_service_gap(["policy=vtc"], seed)
    assert gap <= bound, f"VTC let backlogged tenants' service differ by {gap} > the bound {bound}"
    unfair, _ = largest_service_gap(["policy=fcfs"], seed)
    assert unfair > bound, f"FCFS stayed within the bound too ({unfair} <= {bound}): the scenario tests nothing"
    assert unfair > 4 * gap


def admission_order(overrides: list[str], tenants: list[str]) -> list[str]:
    """The tenants of equal one-token requests, queued in ``tenants``' order, in the
    order a one-request-at-a-time engine admits them."""
    llm = LLM("toy", overrides=[*SIMULATED, "scheduler.max_num_seqs=1", *overrides])
    engine = llm.engine
    requests = captured_requests(engine)
    for tenant in tenants:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True),
                           metadata=RequestMetadata(tenant=tenant))
    while engine.has_unfinished_requests():
        engine.step()
    return [r.metadata.tenant for r in sorted(requests, key=lambda r: r.first_scheduled_time)]


def test_request_count_fairness_admits_alternately():
    order = admission_order(["policy=vtc", "policy.counter=requests"], ["a"] * 4 + ["b"] * 4)
    assert order == ["a", "b"] * 4


def test_tenant_weights_share_service_in_proportion():
    order = admission_order(["policy=vtc", "policy.counter=requests", "+policy.tenant_weights={a:2.0}"],
                            ["a"] * 8 + ["b"] * 8)
    assert order[:9].count("a") == 6


def test_priority_preempts_the_least_urgent_running_request():
    llm = LLM("toy", overrides=["policy=priority", "scheduler.max_num_seqs=2"])
    engine = llm.engine
    requests = captured_requests(engine)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request([1, 2, 3], params, request_id="low", metadata=RequestMetadata(priority=5))
    engine.add_request([4, 5, 6], params, request_id="mid", metadata=RequestMetadata(priority=1))
    engine.step()
    engine.step()
    engine.add_request([7, 8, 9], params, request_id="urgent", metadata=RequestMetadata(priority=-3))
    output = engine.scheduler.schedule()
    assert output.preempted == ("low",)
    assert {g.request.request_id for g in output.scheduled} == {"urgent"}
    by_id = {r.request_id: r for r in requests}
    assert by_id["low"].num_preemptions == 1 and by_id["mid"].num_preemptions == 0


def test_priority_without_preempt_waits():
    llm = LLM("toy", overrides=["policy=priority", "policy.preempt=false", "scheduler.max_num_seqs=1"])
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request([1, 2, 3], params, request_id="low", metadata=RequestMetadata(priority=5))
    engine.step()
    engine.add_request([7, 8, 9], params, request_id="urgent", metadata=RequestMetadata(priority=-3))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["low", "urgent"]


def test_priority_serves_urgent_first_and_keeps_the_tokens():
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM("toy", overrides=["scheduler.max_num_seqs=1"]).generate(prompts, params, use_tqdm=False)
    llm = LLM("toy", overrides=["policy=priority", "scheduler.max_num_seqs=1"])
    requests = captured_requests(llm.engine)
    ordered = llm.generate(prompts, params, use_tqdm=False,
                           metadata=[RequestMetadata(priority=p) for p in (3, -1, 2, 0)])
    assert [o.outputs[0].token_ids for o in ordered] == [o.outputs[0].token_ids for o in plain]
    served = sorted(requests, key=lambda r: r.first_scheduled_time)
    assert [r.metadata.priority for r in served] == [-1, 0, 2, 3]


def deadline_engine(on_hopeless: str):
    return LLM("toy", overrides=["policy=deadline", f"policy.on_hopeless={on_hopeless}", "scheduler.max_num_seqs=1",
                                 "+slo_classes.tight={ttft:0.05,tpot:1}", "+slo_classes.loose={ttft:600,tpot:1}"]).engine


def with_a_late_request(on_hopeless: str, max_tokens: int):
    """A deadline engine (one request at a time) running "first" (class loose) with "late"
    (class tight) queued behind it until its first-token deadline has passed; the engine,
    every request handed to its scheduler and the sampling parameters used."""
    engine = deadline_engine(on_hopeless)
    requests = captured_requests(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request([1, 2, 3], params, request_id="first", metadata=RequestMetadata(slo_class="loose"))
    engine.step()
    engine.add_request([4, 5, 6], params, request_id="late", metadata=RequestMetadata(slo_class="tight"))
    time.sleep(0.1)
    return engine, requests, params


def test_deadline_refuses_hopeless_requests_and_never_admits_them():
    engine, requests, params = with_a_late_request("reject", 40)
    engine.add_request([7, 8, 9], params, request_id="fine", metadata=RequestMetadata(slo_class="loose"))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    late = outputs["late"].outputs[0]
    assert late.finish_reason == "deadline" and late.token_ids == []
    assert next(r for r in requests if r.request_id == "late").first_scheduled_time is None
    assert outputs["fine"].outputs[0].finish_reason == "length"
    assert engine.cache.usage.used_blocks == 0


def test_deadline_deprioritizes_hopeless_requests_behind_every_other():
    engine, requests, params = with_a_late_request("deprioritize", 20)
    for i in range(3):
        engine.add_request([7, 8, 9 + i], params, request_id=f"fine{i}", metadata=RequestMetadata(slo_class="loose"))
    while engine.has_unfinished_requests():
        engine.step()
    served = [r.request_id for r in sorted(requests, key=lambda r: r.first_scheduled_time)]
    assert served == ["first", "fine0", "fine1", "fine2", "late"]
    assert engine.policy.hopeless_ids == set()


def test_deadline_serves_earliest_deadline_first():
    engine = deadline_engine("reject")
    requests = captured_requests(engine)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request([1], params, request_id="running")
    engine.step()
    now = time.time()
    for rid, seconds in (("later", 900), ("none", None), ("sooner", 300)):
        engine.add_request([2, 3], params, request_id=rid,
                           metadata=RequestMetadata(deadline=None if seconds is None else now + seconds))
    while engine.has_unfinished_requests():
        engine.step()
    served = [r.request_id for r in sorted(requests, key=lambda r: r.first_scheduled_time)]
    assert served == ["running", "sooner", "later", "none"]


@pytest.mark.parametrize("metadata,field", [
    (dict(priority="high"), "priority"), (dict(priority=1001), "priority"), (dict(priority=True), "priority"),
    (dict(tenant=""), "tenant"), (dict(tenant="x" * 129), "tenant"), (dict(tenant=3), "tenant"),
    (dict(deadline="soon"), "deadline"), (dict(deadline=float("nan")), "deadline"), (dict(slo_class=""), "slo_class"),
])
def test_bad_metadata_names_the_field(metadata, field):
    with pytest.raises(InvalidRequestError) as error:
        RequestMetadata(**metadata)
    assert error.value.field == field


def test_engine_refuses_unknown_classes_and_past_deadlines_and_keeps_running():
    llm = LLM("toy", overrides=["+slo_classes.chat={ttft:1,tpot:0.1}"])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="unknown SLO class 'batch'; this engine defines: chat") as error:
        llm.generate([[1, 2]], params, use_tqdm=False, metadata=RequestMetadata(slo_class="batch"))
    assert error.value.field == "slo_class"
    with pytest.raises(InvalidRequestError, match="in the past") as error:
        llm.generate([[1, 2]], params, use_tqdm=False, metadata=RequestMetadata(deadline=time.time() - 5))
    assert error.value.field == "deadline"
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[1, 2]], SamplingParams(use_beam_search=True, temperature=0.0, n=2), use_tqdm=False,
                     metadata=RequestMetadata(slo_class="chat"))
    assert error.value.field == "slo_class"
    (output,) = llm.generate([[1, 2]], params, use_tqdm=False, metadata=RequestMetadata(slo_class="chat", tenant="t"))
    assert len(output.outputs[0].token_ids) == 4
    assert llm.engine.cache.usage.used_blocks == 0


@pytest.mark.parametrize("overrides,problem", [
    (["policy=vtc", "policy.counter=bytes"], "policy.counter must be one of tokens, requests"),
    (["policy=vtc", "+policy.tenant_weights={a:0}"], "policy.tenant_weights.a must be > 0"),
    (["policy=deadline", "policy.on_hopeless=drop"], "policy.on_hopeless must be one of reject, deprioritize"),
    (["policy=deadline", "policy.slack=-1"], "policy.slack must be >= 0"),
    (["+slo_classes.chat={ttft:0,tpot:1}"], "slo_classes.chat.ttft must be a number of seconds > 0"),
    (["+slo_classes.chat={ttft:1}"], "slo_classes.chat must be {ttft: seconds, tpot: seconds}"),
])
def test_bad_policy_config_names_the_field(overrides, problem):
    with pytest.raises(ConfigError, match=problem.replace("{", r"\{").replace("}", r"\}")):
        LLM("toy", overrides=overrides)
