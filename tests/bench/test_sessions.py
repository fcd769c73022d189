"""Closed-loop workloads (``workload=multi_turn``, ``workload=agentic``): each request
resends the previous prompt and output, after a think time, within the context."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from servelab.bench.config import AgenticConfig, MultiTurnConfig, WorkloadConfig
from servelab.bench.metrics import RequestRecord
from servelab.bench.runner import measure, open_system
from servelab.bench.sessions import build_sessions
from servelab.bench.workload import BenchRequest, TokenSpace, build_workload
from servelab.checkpoints.toy import byte_level_tokenizer
from servelab.core.errors import ConfigError

SPACE = TokenSpace(257, 512, byte_level_tokenizer())
SIMULATED = ("executor=simulated", "warmup_requests=0", "cache.block_size=4", "workload.rate=4")
CHAT = ("workload=multi_turn", "workload.multi_turn.conversations=3", "workload.multi_turn.turns=[3,4]",
        "workload.lengths=uniform", "workload.input_range=[8,24]", "workload.output_range=[4,8]",
        "workload.prefix_len=16")
AGENT = ("workload=agentic", "workload.agentic.sessions=3", "workload.agentic.steps=[3,4]",
         "workload.agentic.document_len=[16,32]", "workload.agentic.call_output_len=[2,6]",
         "workload.agentic.tool_result_len=[4,12]", "workload.prefix_len=32")


def run_sessions(cfg, tmp_path) -> tuple[list[BenchRequest], list[RequestRecord], object, object]:
    """Run the closed-loop workload of ``cfg`` through servelab in process; every request
    sent (in order of sending), every record, the ``Sessions`` and the system (closed)."""
    system = open_system(cfg, str(tmp_path))
    try:
        sessions = build_sessions(cfg.workload, system.space)
        sent = list(sessions.requests)

        def follow_up(record):
            request = sessions.follow_up(record)
            if request is not None:
                sent.append(request)
            return request

        records, _ = system.run(sessions.requests, follow_up=follow_up)
    finally:
        system.close()
    return sent, records, sessions, system


@pytest.mark.parametrize("preset", [CHAT, AGENT], ids=["multi_turn", "agentic"])
def test_next_request_resends_prompt_and_output_after_the_delay(bench_config, tmp_path, preset):
    cfg = bench_config(*SIMULATED, *preset)
    sent, records, sessions, _ = run_sessions(cfg, tmp_path)
    by_id = {r.request_id: r for r in records}
    requests = {r.request_id: r for r in sent}
    assert len(records) == len(sent) == sum(len(s.turns) for s in sessions.sessions)  # all fit in 512 tokens
    word = "turn" if preset is CHAT else "step"
    preambles = set()
    for i, session in enumerate(sessions.sessions):
        preambles.add(requests[f"{session.name}-{word}0"].prompt_token_ids[:cfg.workload.prefix_len])
        for k in range(1, len(session.turns)):
            before, after = by_id[f"{session.name}-{word}{k - 1}"], by_id[f"{session.name}-{word}{k}"]
            prompt = requests[after.request_id].prompt_token_ids
            assert prompt == (requests[before.request_id].prompt_token_ids + before.output_token_ids
                              + session.turns[k].message)
            assert len(before.output_token_ids) == requests[before.request_id].max_tokens
            # sent exactly the think time (tool latency) after the answer ended, on the virtual clock
            assert after.arrival_time - before.token_times[-1] == pytest.approx(session.turns[k].delay_s, abs=1e-9)
    assert len(preambles) == 1  # one shared system prompt (num_prefixes=1)
    assert any(t.delay_s > 0 for s in sessions.sessions for t in s.turns[1:])  # exponential delays were drawn


def test_fixed_think_time_on_the_virtual_clock(bench_config, tmp_path):
    cfg = bench_config(*SIMULATED, *CHAT, "workload.multi_turn.think_time=fixed", "workload.multi_turn.think_time_s=7.5")
    _, records, _, system = run_sessions(cfg, tmp_path)
    assert system.simulated
    by_id = {r.request_id: r for r in records}
    gaps = [r.arrival_time - by_id[f"{r.request_id.split('-')[0]}-turn{int(r.request_id[-1]) - 1}"].token_times[-1]
            for r in records if not r.request_id.endswith("turn0")]
    assert gaps and all(gap == pytest.approx(7.5) for gap in gaps)


def _record(request: BenchRequest, output: tuple[int, ...], start: float = 0.0) -> RequestRecord:
    return RequestRecord(request.request_id, start, (start + 1.0,) * len(output), len(request.prompt_token_ids),
                         len(output), output_token_ids=output)


def test_a_conversation_stops_when_the_next_prompt_would_not_fit():
    cfg = OmegaConf.structured(WorkloadConfig(lengths="fixed", input_len=20, output_len=10,
                                              multi_turn=MultiTurnConfig(conversations=2, turns=[10, 10])))
    sessions = build_sessions(cfg, TokenSpace(257, 100, None))
    turns = 0
    for request in sessions.requests:
        while request is not None:
            assert len(request.prompt_token_ids) + request.max_tokens <= 100
            turns += 1
            request = sessions.follow_up(_record(request, (7,) * request.max_tokens))
    # prompts of 20, 50, 80 tokens with 10 outputs fit; the fourth would need 110 + 10
    assert turns == 6
    summary = sessions.summary([])
    assert summary["stopped_by_context"] == 2 and summary["sent_turns"] == 6 and summary["planned_turns"] == 20


def test_a_failed_request_ends_its_session():
    cfg = OmegaConf.structured(WorkloadConfig(agentic=AgenticConfig(sessions=1, steps=[3, 3])))
    sessions = build_sessions(cfg, SPACE)
    request = sessions.requests[0]
    failed = RequestRecord(request.request_id, 0.0, (), len(request.prompt_token_ids), 0, error="rejected")
    assert sessions.follow_up(failed) is None
    assert request.request_id == "session0-step0"


@pytest.mark.parametrize("preset", [CHAT, AGENT], ids=["multi_turn", "agentic"])
def test_prefix_caching_hits_the_history_of_later_requests(bench_config, tmp_path, preset):
    rates = {}
    for caching in ("true", "false"):
        cfg = bench_config(*SIMULATED, *preset, f"cache.enable_prefix_caching={caching}")
        system = open_system(cfg, str(tmp_path))
        try:
            metrics = measure(system, cfg)
        finally:
            system.close()
        summary = metrics["sessions"]
        assert summary["later_turns"]["num_requests"] == summary["sent_turns"] - 3 > 0
        rates[caching] = (summary["first_turns"]["prefix_cache_hit_rate"], summary["later_turns"]["prefix_cache_hit_rate"])
        assert metrics["num_completed"] == summary["sent_turns"] and metrics["samples"]["ttft_ms"]
    assert rates["false"] == (0.0, 0.0)
    assert rates["true"][1] > 0.5  # the history: all but a message and a partial block
    assert rates["true"][0] > 0  # the shared system prompt, once the first session cached it


@pytest.mark.parametrize("fields, field", [
    ({"multi_turn": MultiTurnConfig(conversations=0)}, "workload.multi_turn.conversations"),
    ({"multi_turn": MultiTurnConfig(turns=[3, 2])}, "workload.multi_turn.turns"),
    ({"multi_turn": MultiTurnConfig(think_time="gaussian")}, "workload.multi_turn.think_time"),
    ({"multi_turn": MultiTurnConfig(think_time_s=-1.0)}, "workload.multi_turn.think_time_s"),
    ({"agentic": AgenticConfig(sessions=0)}, "workload.agentic.sessions"),
    ({"agentic": AgenticConfig(steps=[0, 2])}, "workload.agentic.steps"),
    ({"agentic": AgenticConfig(steps=[1, 1], tool_result_len=[9, 3])}, "workload.agentic.tool_result_len"),
    ({"agentic": AgenticConfig(tool_latency_s=-0.5)}, "workload.agentic.tool_latency_s"),
    ({"agentic": AgenticConfig(), "multi_turn": MultiTurnConfig()}, "workload.multi_turn and workload.agentic"),
    ({"agentic": AgenticConfig(), "tenants": {"a": {"rate": 1.0}}}, "workload.tenants"),
    ({"multi_turn": MultiTurnConfig(), "prefix_len": -1}, "workload.prefix_len"),
    ({"multi_turn": MultiTurnConfig(), "arrival": "poisson", "rate": 0.0}, "workload.rate"),
])
def test_bad_parameters_name_the_field(fields, field):
    with pytest.raises(ConfigError, match=field):
        build_sessions(OmegaConf.structured(WorkloadConfig(**fields)), SPACE)


def test_closed_loop_workloads_are_not_built_open_loop_nor_on_replicas(bench_config, tmp_path):
    cfg = bench_config(*SIMULATED, *CHAT, "target.replicas=2")
    with pytest.raises(ConfigError, match="workload.multi_turn is closed-loop"):
        build_workload(cfg.workload, SPACE)
    system = open_system(cfg, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="workload.multi_turn is closed-loop: run it on target=inproc"):
            measure(system, cfg)
    finally:
        system.close()


def test_same_seed_same_sessions():
    cfg = OmegaConf.structured(WorkloadConfig(arrival="poisson", multi_turn=MultiTurnConfig(conversations=4)))
    first, again = build_sessions(cfg, SPACE), build_sessions(cfg, SPACE)
    assert first.requests == again.requests
    assert [s.turns for s in first.sessions] == [s.turns for s in again.sessions]
