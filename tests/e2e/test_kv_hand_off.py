"""A request handed off between two engines after its prefill (``LLMEngine.hand_off`` ->
``kv_transfer`` connector -> ``LLMEngine.admit_handed_off``) generates exactly what one
engine generates, leaks no block on either side, and refuses what it cannot move."""

from __future__ import annotations

import pytest

from servelab import ConfigError, InvalidRequestError, LLMEngine, SamplingParams
from servelab.core.engine.registry import get_registry
from servelab.core.hookspecs import hookimpl
from servelab.platform import free_port
from servelab.core.entrypoints.compose import compose_config
from servelab.core.kv_transfer import KVTransferContext, KVTransferError

PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 17, 6)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def engine(*overrides: str) -> LLMEngine:
    return LLMEngine(compose_config(["model=toy", "device=cpu", *overrides]))


def connector(instance_id: str, name: str = "shared_memory", **config):
    registry = get_registry()
    return registry.build("kv_transfer", registry.get("kv_transfer", name).config_cls(**config),
                          KVTransferContext(instance_id, registry))


def run_to_end(llm: LLMEngine) -> dict[str, list[int] | list[tuple[list[int], str]]]:
    """Each finished request's token ids (n=1), or every sequence's token ids and finish reason."""
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = (list(output.outputs[0].token_ids) if len(output.outputs) == 1 else
                                           [(list(c.token_ids), c.finish_reason) for c in output.outputs])
    return done


def first_token_of(llm: LLMEngine, request_id: str) -> bool:
    """Step ``llm`` once; True when ``request_id`` has generated a token."""
    llm.step()
    return llm.outputs.groups[request_id].children[0].num_output_tokens > 0


def one_engine(params: SamplingParams, *overrides: str) -> dict[str, list[int]]:
    llm = engine(*overrides)
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(prompt, params, request_id=f"r{i}")
    done = run_to_end(llm)
    llm.shutdown()
    return done


def disaggregated(params: SamplingParams, prefill_overrides: tuple[str, ...], decode_overrides: tuple[str, ...],
                  connectors: tuple = ()):
    """Prefill every prompt on one engine, hand each off after its first token (through
    ``connectors``, default two shared-memory ones), decode on another."""
    prefill, decode = engine(*prefill_overrides), engine(*decode_overrides)
    sender, receiver = connectors or (connector("prefill-0"), connector("decode-0"))
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(prompt, params, request_id=f"r{i}")
    handed_off = []
    while prefill.has_unfinished_requests():
        assert not [o for o in prefill.step() if o.finished], "a request finished on the prefill side"
        for request_id, group in list(prefill.outputs.groups.items()):
            if request_id in prefill.ready_to_hand_off():
                tickets = prefill.hand_off(request_id, sender)
                assert decode.admit_handed_off(tickets, receiver) == request_id
                handed_off.append(request_id)
    assert sorted(handed_off) == [f"r{i}" for i in range(len(PROMPTS))]
    assert prefill.cache.usage.used_blocks == 0 and sender.num_in_flight == 0
    done = run_to_end(decode)
    assert decode.cache.usage.used_blocks == 0
    prefill.shutdown()
    decode.shutdown()
    return done


@pytest.mark.parametrize("scheduler", ["continuous", "chunked", "static", "dynamic"])
def test_greedy_output_equals_one_engine(scheduler):
    prefill_side = (f"scheduler={scheduler}", "scheduler.token_budget=8") if scheduler == "chunked" else (
        f"scheduler={scheduler}",)
    assert disaggregated(GREEDY, prefill_side, ("scheduler=continuous",)) == one_engine(GREEDY)


def test_torch_distributed_connector_hands_off_the_same():
    port = free_port()
    pair = (connector("prefill-0", "torch_distributed", port=port), connector("decode-0", "torch_distributed", port=port))
    try:
        assert disaggregated(GREEDY, ("scheduler=chunked", "scheduler.token_budget=8"), (), pair) == one_engine(GREEDY)
    finally:
        for end in pair:
            end.shutdown()


def test_seeded_sampling_continues_its_random_stream():
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    assert disaggregated(params, (), ()) == one_engine(params)


class StepLog:
    """The ``StepStats`` of every step of every engine while registered (``with StepLog() as log``)."""

    def __init__(self):
        self.stats = []

    @hookimpl
    def servelab_step_end(self, engine, stats):
        self.stats.append(stats)

    def __enter__(self):
        get_registry().plugin_manager.register(self)
        return self

    def __exit__(self, *exc):
        get_registry().plugin_manager.unregister(self)


def test_preemption_on_the_decode_side_recomputes_and_output_is_unchanged():
    small = ("cache.block_size=4", "cache.num_blocks=12", "model.max_model_len=48")  # prompts fit (11 blocks), outputs not
    with StepLog() as log:
        assert disaggregated(GREEDY, small, small) == one_engine(GREEDY)
    assert sum(stats.num_preempted for stats in log.stats) > 0


def test_speculative_decoding_on_the_decode_side_catches_its_draft_up():
    tiny = ("model=tiny",)
    with StepLog() as log:
        assert disaggregated(GREEDY, tiny, (*tiny, "decoding=speculative", "decoding.num_speculative_tokens=3")) == \
            one_engine(GREEDY, *tiny)
    assert sum(stats.spec_accepted for stats in log.stats) > 0


def test_prefix_caching_and_quantized_kv_on_both_sides():
    sides = ("cache.enable_prefix_caching=true", "cache.kv_dtype=int8")
    assert disaggregated(GREEDY, sides, sides) == one_engine(GREEDY, *sides)


def test_hand_off_before_the_first_token_is_refused_and_the_request_keeps_running():
    llm = engine()
    llm.add_request(PROMPTS[1], GREEDY, request_id="early")
    with pytest.raises(InvalidRequestError, match="'early' cannot be handed off now: it has 0 generated tokens"):
        llm.hand_off("early", connector("prefill-0"))
    with pytest.raises(InvalidRequestError, match="'missing' is not running here"):
        llm.hand_off("missing", connector("prefill-0"))
    assert len(run_to_end(llm)["early"]) == 8
    llm.shutdown()


def test_no_room_leaves_the_ticket_valid():
    prefill, decode = engine("cache.block_size=4"), engine("cache.num_blocks=4", "cache.block_size=4", "model.max_model_len=16")
    sender, receiver = connector("prefill-0"), connector("decode-0")
    decode.add_request(list(range(1, 14)), SamplingParams(max_tokens=2, ignore_eos=True), request_id="holder")
    decode.step()  # the holder takes every block
    prefill.add_request(PROMPTS[0], GREEDY, request_id="moved")
    while not first_token_of(prefill, "moved"):
        pass
    tickets = prefill.hand_off("moved", sender)
    assert decode.admit_handed_off(tickets, receiver) is None
    run_to_end(decode)
    assert decode.admit_handed_off(tickets, receiver) == "moved"
    assert len(run_to_end(decode)["moved"]) == 8
    assert decode.cache.usage.used_blocks == 0
    prefill.shutdown()
    decode.shutdown()


def test_scheduling_metadata_and_cache_salt_travel_with_the_hand_off():
    from servelab import RequestMetadata

    prefill, decode = engine(), engine("policy=priority")
    sender, receiver = connector("prefill-0"), connector("decode-0")
    metadata = RequestMetadata(priority=-3, tenant="acme")
    prefill.add_request(PROMPTS[0], GREEDY, request_id="moved", metadata=metadata, cache_salt="acme-secret")
    while not first_token_of(prefill, "moved"):
        pass
    tickets = prefill.hand_off("moved", sender)
    assert decode.admit_handed_off(tickets, receiver) == "moved"
    (request,) = decode.scheduler.waiting
    assert request.metadata == metadata and request.cache_salt == "acme-secret"
    assert len(run_to_end(decode)["moved"]) == 8
    prefill.shutdown()
    decode.shutdown()


def test_an_aborted_transfer_frees_the_receivers_blocks():
    prefill, decode = engine(), engine()
    sender, receiver = connector("prefill-0"), connector("decode-0")
    prefill.add_request(PROMPTS[2], GREEDY, request_id="gone")
    while not first_token_of(prefill, "gone"):
        pass
    tickets = prefill.hand_off("gone", sender)
    sender.abort(tickets[0])
    with pytest.raises(KVTransferError, match=tickets[0].transfer_id):
        decode.admit_handed_off(tickets, receiver)
    assert decode.cache.usage.used_blocks == 0 and not decode.has_unfinished_requests()
    prefill.shutdown()
    decode.shutdown()


def test_a_simulated_engine_refuses_a_hand_off_naming_the_executor():
    llm = LLMEngine(compose_config(["model=llama-2-7b", "hardware=a100-80gb", "executor=simulated", "cost_model=roofline"]))
    llm.add_request(list(range(1, 9)), GREEDY, request_id="sim")
    while not first_token_of(llm, "sim"):
        pass
    with pytest.raises(ConfigError, match="executor=simulated does not hold the whole KV cache"):
        llm.hand_off("sim", connector("prefill-0"))
    llm.shutdown()


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_every_sequence_of_n_moves_and_continues_its_own_random_stream(cache):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    expected = one_engine(params, f"cache={cache}")
    assert disaggregated(params, (f"cache={cache}",), (f"cache={cache}",)) == expected
    assert all(len(sequences) == 3 for sequences in expected.values())


def test_a_sibling_that_stopped_at_its_first_token_travels_with_the_others():
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    second_first_token = one_engine(params)["r1"][1][0][0]
    stopping = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=7, stop_token_ids=[second_first_token])
    expected = one_engine(stopping)
    assert expected["r1"][1] == ([second_first_token], "stop")
    assert disaggregated(stopping, (), ()) == expected


def test_delta_outputs_of_the_decode_engine_start_at_the_first_token():
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    prefill, decode = engine(), engine()
    sender, receiver = connector("prefill-0"), connector("decode-0")
    prefill.add_request(PROMPTS[1], params, request_id="streamed")
    while not first_token_of(prefill, "streamed"):
        pass
    decode.admit_handed_off(prefill.hand_off("streamed", sender), receiver, output_kind="delta")
    deltas = []
    while decode.has_unfinished_requests():
        deltas += decode.step()
    tokens = [t for delta in deltas for t in delta.outputs[0].token_ids]
    assert tokens == one_engine(GREEDY)["r1"]
    assert sum(len(delta.outputs[0].logprobs) for delta in deltas) == 8
    assert len(deltas[0].prompt_logprobs) == len(PROMPTS[1]) and all(d.prompt_logprobs is None for d in deltas[1:])
    assert "".join(delta.outputs[0].text for delta in deltas) == decode.tokenizer.decode(tokens)
    assert deltas[-1].metrics.arrival_time < deltas[-1].metrics.token_times[0] < deltas[-1].metrics.token_times[1]
    prefill.shutdown()
    decode.shutdown()


def test_delta_outputs_continue_after_what_the_prefill_engine_streamed():
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2)
    prefill, decode = engine(), engine()
    sender, receiver = connector("prefill-0"), connector("decode-0")
    prefill.add_request(PROMPTS[1], params, request_id="streamed", output_kind="delta")
    first = []
    while "streamed" not in prefill.ready_to_hand_off():
        first += prefill.step()
    decode.admit_handed_off(prefill.hand_off("streamed", sender), receiver, output_kind="delta")
    deltas = list(first)
    while decode.has_unfinished_requests():
        deltas += decode.step()
    expected = one_engine(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2))["r1"]
    for i, (tokens, _) in enumerate(expected):
        assert [t for delta in deltas for t in delta.outputs[i].token_ids] == tokens
        assert sum(len(delta.outputs[i].logprobs) for delta in deltas) == 8
        assert "".join(delta.outputs[i].text for delta in deltas) == decode.tokenizer.decode(tokens)
    assert all(sum(len(d.outputs[i].token_ids) for d in first) >= 1 for i in range(2))  # from the prefill engine
    assert len(deltas[0].prompt_logprobs) == len(PROMPTS[1]) and all(d.prompt_logprobs is None for d in deltas[1:])
    prefill.shutdown()
    decode.shutdown()


def test_tickets_of_different_requests_are_refused():
    prefill, decode = engine(), engine()
    sender, receiver = connector("prefill-0"), connector("decode-0")
    for request_id in ("a", "b"):
        prefill.add_request(PROMPTS[0], GREEDY, request_id=request_id)
    while not first_token_of(prefill, "b"):
        pass
    mixed = prefill.hand_off("a", sender) + prefill.hand_off("b", sender)
    with pytest.raises(InvalidRequestError, match="tickets: must be every ticket of one hand-off"):
        decode.admit_handed_off(mixed, receiver)
    assert decode.cache.usage.used_blocks == 0
    prefill.shutdown()
    decode.shutdown()
