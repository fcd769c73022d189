"""Multi-LoRA serving: requests of several PEFT adapters (different ranks and target
modules) and of the base model in one batch equal ``peft``'s merged models, greedy in
float32, under every batching shape; bad adapters are refused naming the field."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.testing import assert_no_leaked_blocks, mixed_prompts, tiny_checkpoint, transformers_greedy

peft = pytest.importorskip("peft")

ADAPTERS = {"a": (4, ["q_proj", "v_proj", "down_proj"]),
            "b": (8, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
            "c": (2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
"""name: (rank, target modules)."""
MAX_TOKENS = 10


def save_adapter(base: str, folder: str, rank: int, targets: list[str], seed: int, **config) -> str:
    """A random PEFT adapter of ``base`` (B non-zero) saved to ``folder``; its merged model
    beside it in ``folder + '-merged'``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config))
    model.save_pretrained(folder)
    model.merge_and_unload().save_pretrained(folder + "-merged")
    return folder


@pytest.fixture(scope="module")
def lora_setup(llama, tmp_path_factory):
    """The tiny Llama, three adapters of it, prompts with their adapters (None: the base
    model) and the reference tokens of each."""
    root = tmp_path_factory.mktemp("lora")
    folders = {name: save_adapter(llama, str(root / name), rank, targets, seed)
               for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), 1)}
    prompts = mixed_prompts(257, lengths=(3, 17, 40, 9, 30, 12))
    loras = ["a", None, "b", "c", "a", "b"]
    expected = [transformers_greedy(llama if name is None else folders[name] + "-merged", [prompt], MAX_TOKENS)[0]
                for prompt, name in zip(prompts, loras)]
    return dict(base=llama, folders=folders, prompts=prompts, loras=loras, expected=expected, root=root)


def lora_llm(setup, *overrides: str, adapters: tuple[str, ...] = tuple(ADAPTERS)) -> LLM:
    listed = ", ".join(f"{name}: '{setup['folders'][name]}'" for name in adapters)
    return LLM(setup["base"], overrides=["model.dtype=float32", "device=cpu", f"lora.adapters={{{listed}}}",
                                         *overrides])


def assert_matches(llm: LLM, setup: dict) -> list:
    outputs = llm.generate(setup["prompts"], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False, lora=setup["loras"])
    for i, (output, expected) in enumerate(zip(outputs, setup["expected"])):
        assert output.outputs[0].token_ids == expected, f"prompt {i} with adapter {setup['loras'][i]}"
    assert_no_leaked_blocks(llm)
    return outputs


def test_adapters_differ_from_the_base_model(lora_setup):
    """The references themselves: every adapter changes its prompts' greedy tokens."""
    base = transformers_greedy(lora_setup["base"], lora_setup["prompts"], MAX_TOKENS)
    changed = [got != plain for got, plain, name in zip(lora_setup["expected"], base, lora_setup["loras"]) if name]
    assert all(changed)


@pytest.mark.parametrize("overrides", [
    ("scheduler=continuous",),
    ("scheduler=chunked", "scheduler.token_budget=24"),
    ("scheduler=static", "scheduler.max_batch_size=4"),
    ("scheduler=dynamic", "scheduler.max_batch_size=3"),
    ("model.max_model_len=96", "cache.block_size=4", "cache.num_blocks=24", "scheduler.max_num_batched_tokens=96"),
    ("model.max_model_len=96", "cache.block_size=4", "cache.num_blocks=24", "scheduler.max_num_batched_tokens=96",
     "scheduler.preemption=swap", "cache.swap_space_bytes=1000000"),
    ("decoding=ngram",),
    ("decoding=speculative", "decoding.draft_path='{base}'", "decoding.num_speculative_tokens=3"),
], ids=["continuous", "chunked", "static", "dynamic", "preempt-recompute", "preempt-swap", "ngram", "draft-model"])
def test_mixed_adapters_in_one_batch_equal_peft_merged_models(lora_setup, overrides):
    """The draft model of speculative decoding runs without adapters, the target with them."""
    llm = lora_llm(lora_setup, *(o.format(base=lora_setup["base"]) for o in overrides))
    assert_matches(llm, lora_setup)
    if "cache.num_blocks=24" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0


def test_more_adapters_than_slots_page_in_and_out(lora_setup):
    """One slot for three adapters, admission by the scheduler alone: each step runs one
    pass per adapter, paging the least recently used out; output is unchanged and the
    counters say what happened."""
    llm = lora_llm(lora_setup, "lora.max_adapters=1", "lora.admission=false")
    assert_matches(llm, lora_setup)
    stats = llm.engine.executor.lora_stats()
    assert stats.slots == 1 and stats.misses >= 3 and stats.evictions >= 2 and stats.split_steps > 0
    assert 0 < stats.hit_rate < 1 and stats.load_seconds > 0


def test_byte_budget_sets_the_slot_count(lora_setup):
    llm = lora_llm(lora_setup, "lora.memory_bytes=300000", "lora.max_rank=8")
    assert llm.engine.executor.lora_stats().slots == 300000 // llm.engine.executor.lora.slot_bytes
    with pytest.raises(ConfigError, match="lora.memory_bytes=1000 holds no adapter slot"):
        lora_llm(lora_setup, "lora.memory_bytes=1000")


def test_prefix_cache_is_never_shared_between_adapters(lora_setup):
    """One prompt under the base model and each adapter with prefix caching: every output
    is its own model's; a second run of an adapter reuses its own blocks."""
    llm = lora_llm(lora_setup, "cache.enable_prefix_caching=true", "cache.block_size=4")
    prompt = lora_setup["prompts"][2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for name in (None, "a", "b", "a"):
        folder = lora_setup["base"] if name is None else lora_setup["folders"][name] + "-merged"
        got = llm.generate([prompt], params, use_tqdm=False, lora=name)[0].outputs[0].token_ids
        assert got == transformers_greedy(folder, [prompt], MAX_TOKENS)[0], name
    assert_no_leaked_blocks(llm)


def test_load_and_unload_at_run_time(lora_setup):
    """An adapter loaded after start-up serves at once; unloading refuses new requests for
    it while one already running finishes with it."""
    setup = lora_setup
    llm = lora_llm(setup, adapters=("a",))
    engine = llm.engine
    engine.load_lora_adapter("b", setup["folders"]["b"])
    assert set(engine.lora_adapters()) == {"a", "b"}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    request = engine.add_request(setup["prompts"][2], params, lora="b")
    engine.step()
    engine.unload_lora_adapter("b")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'b'; loaded: a") as refused:
        engine.add_request(setup["prompts"][2], params, lora="b")
    assert refused.value.field == "lora"
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished[request].outputs[0].token_ids == setup["expected"][2]
    assert_no_leaked_blocks(llm)


def test_bad_adapters_are_refused_naming_the_field(lora_setup, llama, tmp_path):
    setup = lora_setup
    llm = lora_llm(setup, "lora.max_rank=4", adapters=("a",))
    engine = llm.engine
    other_base = tiny_checkpoint(tmp_path / "wide", hidden_size=96)
    deeper_base = tiny_checkpoint(tmp_path / "deep", num_hidden_layers=3)
    cases = {
        "r": setup["folders"]["b"],  # rank 8 > 4
        "lora_path": save_adapter(other_base, str(tmp_path / "wide-lora"), 2, ["q_proj"], 0),
        "target_modules": save_adapter(deeper_base, str(tmp_path / "deep-lora"), 2, ["q_proj"], 0,
                                       layers_to_transform=[2]),
    }
    for field, folder in cases.items():
        with pytest.raises(InvalidRequestError) as refused:
            engine.load_lora_adapter("x", folder)
        assert refused.value.field == field, refused.value
    with pytest.raises(InvalidRequestError, match="is not a PEFT adapter folder: it has no adapter_config.json"):
        engine.load_lora_adapter("x", llama)
    with pytest.raises(InvalidRequestError, match="already loaded"):
        engine.load_lora_adapter("a", setup["folders"]["a"])
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'zzz'"):
        llm.generate(setup["prompts"][:1], lora="zzz")
    assert engine.lora_adapters().keys() == {"a"}
    assert_matches(llm, {**setup, "prompts": setup["prompts"][:1], "loras": ["a"], "expected": setup["expected"][:1]})


def test_refusals_at_start_up(lora_setup, tmp_path):
    folder = tmp_path / "dora"
    save_adapter(lora_setup["base"], str(folder), 2, ["q_proj"], 0)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match=r"lora.adapters.d: use_dora: .* DoRA adapters are not supported"):
        LLM(lora_setup["base"], overrides=["device=cpu", f"lora.adapters={{d: '{folder}'}}"])
    with pytest.raises(InvalidRequestError, match="this engine serves no LoRA adapters") as refused:
        LLM(lora_setup["base"], overrides=["device=cpu"]).generate([[1, 2, 3]], lora="a")
    assert refused.value.field == "lora"


def test_adapters_loaded_and_unloaded_while_requests_run(lora_setup):
    """Requests of every adapter enter between steps while adapters are unloaded and
    loaded again under the same name (a new load: its own prefix-cache salt) on two slots
    with prefix caching: every output is its adapter's, and nothing is left behind: no KV
    block, no unloaded adapter in a slot."""
    setup = lora_setup
    llm = lora_llm(setup, "lora.max_adapters=2", "cache.enable_prefix_caching=true", "cache.block_size=4")
    engine, slots = llm.engine, llm.engine.executor.lora
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected, finished = {}, {}

    def add(index: int) -> None:
        request = engine.add_request(setup["prompts"][index], params, lora=setup["loras"][index])
        expected[request] = setup["expected"][index]

    for round_ in range(3):
        for index in range(len(setup["prompts"])):
            add(index)
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.unload_lora_adapter("b")
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.load_lora_adapter("b", setup["folders"]["b"])
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert {rid: o.outputs[0].token_ids for rid, o in finished.items()} == expected
    assert_no_leaked_blocks(llm)
    for name in ADAPTERS:
        engine.unload_lora_adapter(name)
    llm.generate(setup["prompts"][:1], params, use_tqdm=False)
    assert not slots.resident and all(not any(layer.widths) for layer in slots.layers.values())


@pytest.mark.parametrize("family,targets", [
    ("qwen2", ["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"]),  # q/k/v biases
    ("phi3", ["qkv_proj", "gate_up_proj"]),                             # fused in the checkpoint too
    ("opt", ["q_proj", "v_proj", "fc1", "fc2"]),
    ("falcon", ["query_key_value", "dense_4h_to_h"]),                    # interleaved q/k/v rows
])
def test_other_families_equal_peft_merged_models(family, targets, tmp_path):
    base = tiny_checkpoint(tmp_path / "base", family)
    folder = save_adapter(base, str(tmp_path / "adapter"), 4, targets, 1)
    llm = LLM(base, overrides=["model.dtype=float32", "device=cpu", f"lora.adapters={{x: '{folder}'}}"])
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(5, 20))
    outputs = llm.generate(prompts + prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
                           lora=["x", "x", None, None])
    expected = transformers_greedy(folder + "-merged", prompts, 8) + transformers_greedy(base, prompts, 8)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected[:2] != expected[2:]


def test_triton_segment_kernel_path_equals_peft_merged_models(lora_setup):
    """The CUDA path (each request a segment, two launches of the Triton kernel per
    projection), here in Triton's interpreter on a few short requests."""
    pytest.importorskip("triton")
    from servelab.kernels.availability import triton_interpret_enabled

    if not triton_interpret_enabled() and not torch.cuda.is_available():
        pytest.skip("Triton runs neither in its interpreter nor on a GPU here")
    llm = lora_llm(lora_setup)
    llm.engine.executor.lora.segmented = True
    picked = [0, 1, 3]
    outputs = llm.generate([lora_setup["prompts"][i] for i in picked], SamplingParams(temperature=0.0, max_tokens=4),
                           use_tqdm=False, lora=[lora_setup["loras"][i] for i in picked])
    assert [o.outputs[0].token_ids for o in outputs] == [lora_setup["expected"][i][:4] for i in picked]


def test_prompt_logprobs_and_parallel_sequences_survive_split_steps(lora_setup):
    """Prompt logprobs and n=2 sequences of requests of three adapters and the base model:
    one slot (each step split into a pass per adapter, the rows put back in order) gives
    what a slot per adapter gives, and both sequences are the adapter's greedy tokens."""
    setup = lora_setup
    params = SamplingParams(temperature=0.0, max_tokens=4, n=2, prompt_logprobs=1)
    runs = []
    for slots in (1, 4):
        outputs = lora_llm(setup, f"lora.max_adapters={slots}", "lora.admission=false").generate(
            setup["prompts"][:4], params, use_tqdm=False, lora=setup["loras"][:4])
        for output, expected in zip(outputs, setup["expected"]):
            assert [c.token_ids for c in output.outputs] == [expected[:4]] * 2
        runs.append([[None if entry is None else {t: lp.logprob for t, lp in entry.items()}
                      for entry in output.prompt_logprobs] for output in outputs])
    assert [[None if e is None else sorted(e) for e in p] for p in runs[0]] == \
        [[None if e is None else sorted(e) for e in p] for p in runs[1]]
    for split, whole in zip(runs[0], runs[1]):
        for a, b in zip(split, whole):
            assert a is None or a == pytest.approx(b, abs=1e-5)


def test_a_simulated_engine_serves_peft_adapters(lora_setup):
    """executor=simulated pages a PEFT adapter into its slots and prices it (tests/sim/test_lora_sim.py)."""
    llm = LLM(lora_setup["base"], overrides=["device=cpu", "executor=simulated", "cost_model=roofline",
                                             f"lora.adapters={{a: '{lora_setup['folders']['a']}'}}"])
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False, lora="a")
    assert len(out[0].outputs[0].token_ids) == 2 and llm.engine.executor.lora_stats().misses == 1


def test_shutdown_releases_adapters_and_slots(lora_setup):
    llm = lora_llm(lora_setup, adapters=("a",))
    llm.generate(lora_setup["prompts"][:1], SamplingParams(max_tokens=2), use_tqdm=False, lora="a")
    slots = weakref.ref(llm.engine.executor.lora)
    adapter = weakref.ref(llm.engine.lora_adapter("a").modules[0].a)  # its host weights
    llm.shutdown()
    gc.collect()
    assert slots() is None and adapter() is None


def test_command_line_runs_prompts_with_an_adapter(lora_setup, capsys):
    """``servelab ... adapter=<name>``: the prompts run with that adapter."""
    from servelab.core.entrypoints.cli import complete
    from servelab.core.entrypoints.compose import compose_config

    folder = lora_setup["folders"]["a"]
    cfg = compose_config(["model=local", f"model.path='{lora_setup['base']}'", "model.dtype=float32", "device=cpu",
                          f"lora.adapters={{a: '{folder}'}}", "adapter=a", "sampling.temperature=0",
                          "sampling.repetition_penalty=1", f"sampling.max_tokens={MAX_TOKENS}", "use_tqdm=false",
                          "prompt='def add(a, b):'"])
    complete(cfg)
    llm = lora_llm(lora_setup, adapters=("a",))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with_adapter = llm.generate(["def add(a, b):"], params, use_tqdm=False, lora="a")[0].outputs[0].text
    assert llm.generate(["def add(a, b):"], params, use_tqdm=False)[0].outputs[0].text != with_adapter
    assert "def add(a, b):" + with_adapter in capsys.readouterr().out


def test_hand_off_between_engines_keeps_the_adapter(lora_setup):
    """A LoRA request prefilled on one engine and decoded on another (disaggregated
    serving) runs with the decode engine's adapter of the same name; one that this
    engine does not serve is refused naming ``lora``."""
    from servelab.core.engine.registry import get_registry
    from servelab.core.kv_transfer import KVTransferContext

    registry = get_registry()
    ends = [registry.build("kv_transfer", registry.get("kv_transfer", "shared_memory").config_cls(),
                           KVTransferContext(name, registry)) for name in ("prefill-0", "decode-0")]
    prefill, decode = lora_llm(lora_setup).engine, lora_llm(lora_setup, adapters=("a", "b")).engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    picked = [0, 1, 2, 3]
    ids = {prefill.add_request(lora_setup["prompts"][i], params, lora=lora_setup["loras"][i]): i for i in picked}
    refused = []
    while prefill.has_unfinished_requests():
        prefill.step()
        for request_id in prefill.ready_to_hand_off():
            tickets = prefill.hand_off(request_id, ends[0])
            try:
                assert decode.admit_handed_off(tickets, ends[1]) == request_id
            except InvalidRequestError as exc:
                assert exc.field == "lora"
                refused.append(request_id)
                for ticket in tickets:
                    ends[1].abort(ticket)
    done = {}
    while decode.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in decode.step() if o.finished)
    assert [lora_setup["loras"][ids[r]] for r in refused] == ["c"]
    assert done == {r: lora_setup["expected"][i] for r, i in ids.items() if r not in refused}
    assert prefill.cache.usage.used_blocks == 0 and decode.cache.usage.used_blocks == 0


def test_tensor_parallelism_splits_adapters_as_it_splits_the_base_layers(lora_setup):
    """Two ranks (gloo): each keeps its rows of B for the column-parallel projections
    (q/k/v, gate/up) and its input columns of A for the row-parallel ones (o, down); the
    driver pages adapters into two slots for three adapters and the workers mirror it,
    an adapter unloaded and loaded again included."""
    llm = lora_llm(lora_setup, "parallel.tensor_parallel_size=2", "lora.max_adapters=2", "lora.admission=false")
    try:
        assert_matches(llm, lora_setup)
        llm.engine.unload_lora_adapter("b")
        llm.engine.load_lora_adapter("b", lora_setup["folders"]["b"])
        assert_matches(llm, lora_setup)
        assert llm.engine.executor.lora_stats().split_steps > 0
    finally:
        llm.shutdown()


def test_pipeline_parallelism_keeps_each_stages_layers_of_the_adapters(lora_setup):
    """Two stages (gloo), one layer each: every stage holds the adapters' weights of its own
    layer only; two slots for three adapters, so steps split into passes, each run
    through both stages before the next."""
    llm = lora_llm(lora_setup, "parallel.pipeline_parallel_size=2", "lora.max_adapters=2", "lora.admission=false")
    try:
        assert_matches(llm, lora_setup)
        placed = {p.layer.split(".")[2] for load_id in llm.engine.executor.lora.placements
                  for p in llm.engine.executor.lora.placements[load_id]}
        assert placed == {"0"}  # the first stage's one layer (layer 1 is the second stage's)
        assert llm.engine.executor.lora_stats().split_steps > 0
        with pytest.raises(InvalidRequestError, match="target_modules"):
            llm.engine.load_lora_adapter("deep", save_adapter(
                tiny_checkpoint(lora_setup["root"] / "deeper", num_hidden_layers=3), str(lora_setup["root"] / "deep"),
                2, ["q_proj"], 0))
    finally:
        llm.shutdown()
