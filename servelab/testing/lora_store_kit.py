"""Conformance kit for adapter stores (``lora.store``): the ``LoRAStore`` contract on its
own, and an engine serving adapters read through the store."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from servelab.testing.kit import ConformanceKit

TOY_MODULES = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (64, 32), "mlp.down_proj": (128, 64)}
"""Projections of ``model=toy`` (conf/model/toy.yaml) an adapter may adapt: (in, out) features."""
ADAPTERS = {"alpha": (4, ("self_attn.q_proj", "mlp.down_proj")), "beta": (8, ("self_attn.v_proj",))}
"""The kit's adapters: name to (rank, adapted projections of both layers)."""
BROKEN = ("no-weights", "not-lora", "truncated")
"""Folders that are not servable adapters: a config without weights, another PEFT method,
a damaged weight file."""


def write_peft_adapter(folder: str, rank: int, modules: tuple[str, ...], seed: int) -> dict[str, Any]:
    """A random LoRA adapter of ``model=toy`` in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``) in ``folder``; returns its tensors by PEFT's names."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in modules:
            features_in, features_out = TOY_MODULES[module]
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * 0.3
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": sorted(m.rpartition(".")[2] for m in modules)}
    with open(os.path.join(folder, "adapter_config.json"), "w") as handle:
        json.dump(config, handle)
    return tensors


PROMPT_LENGTHS, LORAS, MAX_TOKENS = (5, 12, 9), ("alpha", "beta", None), 6
ENGINE = ("model.max_model_len=64", "lora.max_rank=8", "lora.max_adapters=2")


@functools.lru_cache(maxsize=1)
def local_reference() -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of the kit's prompts with ``LORAS`` and without adapters, from the
    kit's adapters read by ``lora.store=local`` (the same for every store: computed once)."""
    import tempfile

    from servelab import LLM, SamplingParams
    from servelab.testing.oracle import mixed_prompts

    prompts, params = mixed_prompts(257, lengths=PROMPT_LENGTHS), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with tempfile.TemporaryDirectory() as root:
        for seed, (name, (rank, modules)) in enumerate(ADAPTERS.items(), 1):
            write_peft_adapter(os.path.join(root, name), rank, modules, seed)
        folders = ", ".join(f"{name}: '{os.path.join(root, name)}'" for name in ADAPTERS)
        llm = LLM("toy", overrides=[*ENGINE, f"lora.adapters={{{folders}}}"])
        adapted = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False, lora=list(LORAS))]
        base = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    return adapted, base


def _write_broken(root: str) -> None:
    for name in BROKEN:
        os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, "no-weights", "adapter_config.json"), "w") as handle:
        json.dump({"peft_type": "LORA", "r": 4}, handle)
    write_peft_adapter(os.path.join(root, "not-lora"), 4, ("self_attn.q_proj",), 0)
    with open(os.path.join(root, "not-lora", "adapter_config.json"), "w") as handle:
        json.dump({"peft_type": "IA3"}, handle)
    write_peft_adapter(os.path.join(root, "truncated"), 4, ("self_attn.q_proj",), 0)
    weights = os.path.join(root, "truncated", "adapter_model.safetensors")
    with open(weights, "r+b") as handle:
        handle.truncate(os.path.getsize(weights) // 2)


class LoRAStoreConformance(ConformanceKit):
    """The ``LoRAStore`` contract: ``fetch`` returns an adapter's PEFT config and tensors as
    written, and ``fetch(name, source)`` reads the same adapter again (how parallel
    workers read theirs); ``available`` lists nothing or the folders published, sorted,
    each adapter served by name alone; an unknown adapter, a folder with no weights,
    another PEFT method and a damaged file are each an ``InvalidRequestError`` naming a
    field (``lora_name``/``lora_path``, ``peft_type`` for another method: the engine's
    check). Through an engine on ``model=toy``: adapters loaded at start-up and at run
    time through the store give the greedy output of the same folders read by
    ``lora.store=local``, and each changes its requests' tokens.

    A store that keeps adapters elsewhere overrides ``publish`` (put the kit's folders
    where it serves them; return its ``lora.store_path``) and ``request_path`` (the
    ``lora_path`` a load gives for one of them)."""

    kind = "lora_store"

    def publish(self, component: str, root: str) -> str | None:
        """Serve the PEFT folders under ``root`` (one per adapter, named after it) from
        ``component``; returns its ``lora.store_path`` (default: ``root``)."""
        return root

    def request_path(self, component: str, name: str, root: str) -> str | None:
        """The ``lora_path`` that loads adapter ``name`` (default: its folder under ``root``)."""
        return os.path.join(root, name)

    def _published(self, component: str, tmp_path: Any) -> tuple[Any, str, dict[str, Any]]:
        from servelab.core.engine.registry import get_registry
        from servelab.core.lora_store import LoRAStoreContext

        root = str(tmp_path / "adapters")
        written = {name: write_peft_adapter(os.path.join(root, name), rank, modules, seed)
                   for seed, (name, (rank, modules)) in enumerate(ADAPTERS.items(), 1)}
        _write_broken(root)
        store = get_registry().get("lora_store", component).cls(LoRAStoreContext(self.publish(component, root)))
        return store, root, written

    def test_fetch_reads_the_adapters_as_written(self, component, tmp_path):
        import torch

        store, root, written = self._published(component, tmp_path)
        listed = store.available()
        assert listed == sorted(listed) and (not listed or set(ADAPTERS) <= set(listed) <= {*ADAPTERS, *BROKEN}), \
            f"available() lists {listed}: not sorted, or not the folders published"
        for name, tensors in written.items():
            first = store.fetch(name, self.request_path(component, name, root))
            again = store.fetch(name, first.source)
            for stored in (first, again, *([store.fetch(name, None)] if listed else [])):
                assert stored.source == first.source
                assert stored.config["peft_type"] == "LORA" and stored.config["r"] == ADAPTERS[name][0]
                assert stored.tensors.keys() == tensors.keys()
                assert all(torch.equal(stored.tensors[key], value) for key, value in tensors.items())

    def test_unservable_adapters_name_the_field(self, component, tmp_path):
        from servelab.core.errors import InvalidRequestError
        from servelab.core.lora_adapter import adapter_from_peft

        store, root, _ = self._published(component, tmp_path)
        for name in ("missing", *BROKEN):
            try:
                adapter_from_peft(name, store.fetch(name, self.request_path(component, name, root)), 16)
            except InvalidRequestError as exc:
                expected = "peft_type" if name == "not-lora" else ("lora_name", "lora_path")
                assert exc.field in expected, f"{name}: {exc.field!r}: {exc}"
            else:
                raise AssertionError(f"adapter {name!r} loaded")

    def test_engine_serves_adapters_from_the_store(self, component, tmp_path):
        from servelab import LLM, SamplingParams
        from servelab.testing.oracle import assert_no_leaked_blocks, mixed_prompts

        store, root, _ = self._published(component, tmp_path)
        location = self.publish(component, root)
        by_name = bool(store.available())
        path = {name: self.request_path(component, name, root) for name in ADAPTERS}
        first = "alpha: null" if by_name else f"alpha: '{path['alpha']}'"
        llm = LLM("toy", overrides=[*ENGINE, "lora.enabled=true", f"lora.store={component}",
                                    f"lora.store_path={location}" if location else "lora.store_path=null",
                                    f"lora.adapters={{{first}}}"])
        llm.engine.load_lora_adapter("beta", None if by_name else path["beta"])
        assert llm.engine.lora_adapters() == {name: store.fetch(name, path[name]).source for name in ADAPTERS}
        prompts = mixed_prompts(257, lengths=PROMPT_LENGTHS)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False,
                               lora=list(LORAS))
        assert_no_leaked_blocks(llm)
        llm.shutdown()
        expected, base = local_reference()
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert all(adapted != plain for adapted, plain, name in zip(expected, base, LORAS) if name), \
            "an adapter left its requests' tokens unchanged"
