"""``servelab-serve deployment=disaggregated``: prefill and decode engine processes behind
the one OpenAI-compatible server answer as one mixed engine does (the API tests of
test_openai_client.py and test_openai_structured_output.py run again against a 1P1D
server); several prefill instances with their own scheduler, a decode pool with its own
decoding, aborts, a killed decode instance, and settings that cannot work."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
from server_process import API_KEY, MODEL, ServerProcess
from test_openai_client import (PROMPTS, test_completion_equals_offline_greedy,  # noqa: F401 (run here too)
                                test_echo_with_logprobs_scores_the_prompt_as_offline, test_logprobs_completion_and_chat,
                                test_n_choices_streamed_and_not, test_stop_strings_match_offline,
                                test_streamed_completion_equals_offline_greedy_with_usage,
                                test_token_id_prompts_batches_and_echo)
from test_openai_structured_output import test_completion_with_a_json_schema  # noqa: F401
from test_parallel_faults import alive, spawned_children

from servelab.core.errors import ConfigError
from servelab.platform import free_port
from servelab.server.config import compose_serve_config
from servelab.server.deployment import plan_instances

ONE_P_ONE_D = ("deployment=disaggregated", f"server.api_key={API_KEY}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A 1P1D server: the tests imported above run against it."""
    proc = ServerProcess(tmp_path_factory.mktemp("disaggregated") / "server.log", *ONE_P_ONE_D)
    yield proc
    proc.stop()


def metric(http: httpx.Client, name: str) -> float:
    """The value of an unlabelled Prometheus metric."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def complete_concurrently(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Every prompt's greedy completion from the server at ``url``, all sent at once."""
    with httpx.Client(base_url=url, timeout=120) as client:
        def complete(prompt: str) -> str:
            response = client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(complete, prompts))


def test_seeded_sampling_continues_on_the_decode_instance(client, offline):
    from servelab import SamplingParams

    params = dict(temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    (expected,) = offline.generate([PROMPTS[0]], SamplingParams(**params), use_tqdm=False)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], **params)
    assert result.choices[0].text == expected.outputs[0].text


def test_a_request_ending_at_its_first_token_is_answered_by_the_prefill_instance(client, greedy):
    (text, _, finish), = greedy(PROMPTS[:1], 1)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (text, finish)


def test_aborted_streams_free_every_block_of_both_instances(server, http):
    for _ in range(3):
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}) as stream:
            assert next(line for line in stream.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 30
    while metric(http, "servelab:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(http, "servelab:kv_cache_usage_perc") == 0
    assert metric(http, "servelab:num_requests_running") == 0


def test_a_prompt_too_long_is_refused_naming_the_limit(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 600, "max_tokens": 4})
    assert response.status_code == 400 and "maximum context length is 512 tokens" in response.text, response.text


def test_two_prefill_instances_with_chunked_prefills_an_ngram_decode_pool_over_torch_distributed(tmp_path, greedy):
    server = ServerProcess(tmp_path / "server.log", "deployment=disaggregated", "deployment.prefill.instances=2",
                           'deployment.prefill.overrides=["scheduler=chunked","scheduler.token_budget=16"]',
                           'deployment.decode.overrides=["decoding=ngram"]', "router=least_loaded",
                           "kv_transfer=torch_distributed", f"kv_transfer.port={free_port()}")
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(8)]
        assert complete_concurrently(server.url, prompts, 12) == [text for text, _, _ in greedy(prompts, 12)]
        log = server.log()
        assert "prefill-0 ready (role prefill" in log and "prefill-1 ready (role prefill" in log, log
    finally:
        server.stop()


def test_a_killed_decode_instance_fails_requests_and_leaves_no_process(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "deployment=disaggregated")
    try:
        engines = spawned_children(server.process.pid)
        assert len(engines) == 2
        decode = next(pid for pid in engines if f"decode-0 ready (role decode, pid {pid}" in server.log())
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={
                    "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(decode, signal.SIGKILL)
                rest = "\n".join(lines)
            assert "engine instance decode-0 exited" in rest and "engine_dead" in rest, rest[-2000:]
        assert server.process.wait(60) == 1, server.log()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in engines)
    finally:
        server.stop()


def test_a_deployment_asking_for_more_threads_than_cores_names_the_settings():
    cfg = compose_serve_config(["model=toy", "deployment=disaggregated", "deployment.prefill.engine_threads=2",
                                "deployment.decode.instances=2"])
    with pytest.raises(ConfigError, match=r"deployment asks for 4 compute threads .* more than the 3 cores"):
        plan_instances(cfg, cores=[0, 1, 2])


def test_instances_get_cores_of_their_own_when_the_cores_go_round():
    cfg = compose_serve_config(["model=toy", "deployment=disaggregated", "deployment.decode.instances=2"])
    plans = plan_instances(cfg, cores=[0, 1, 2, 3, 4, 5])
    assert [(p.name, p.cfg.role, p.threads, p.cores) for p in plans] == [
        ("prefill-0", "prefill", 2, (0, 1)), ("decode-0", "decode", 2, (2, 3)), ("decode-1", "decode", 2, (4, 5))]
    shared = plan_instances(cfg, cores=[0, 1])
    assert [(p.threads, p.cores) for p in shared] == [(1, None)] * 3


@pytest.mark.parametrize("overrides, phrase", [
    (["deployment.decode.instances=0"], "deployment.decode.instances must be at least 1"),
    (['deployment.prefill.overrides=["server.port=1"]'], "deployment.prefill.overrides: 'server.port=1'"),
    (["role=prefill"], "role=prefill is set per pool"),
])
def test_bad_pools_name_the_field(overrides, phrase):
    cfg = compose_serve_config(["model=toy", "deployment=disaggregated", *overrides])
    with pytest.raises(ConfigError, match=phrase):
        plan_instances(cfg)


def test_an_unknown_role_and_a_parallel_prefill_instance_are_refused(tmp_path):
    from servelab.core.engine.llm_engine import LLMEngine
    from servelab.core.entrypoints.compose import compose_config

    with pytest.raises(ConfigError, match="role must be one of mixed, prefill, decode, got 'both'"):
        LLMEngine(compose_config(["model=toy", "role=both"]))
    with pytest.raises(RuntimeError, match=r"(?s)server exited with 2.*role=prefill needs the whole KV cache"):
        ServerProcess(tmp_path / "server.log", "deployment=disaggregated",
                      'deployment.prefill.overrides=["parallel.tensor_parallel_size=2"]')
