"""docs/plugins.md lists exactly each contract's members (required ones are the abstract
ones, optional ones exist with defaults, and nothing public is left out) and each
context's fields, in order."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import re

import pytest
from torch import nn

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
CONTRACTS = re.findall(r"^### (\w+) — `([\w.]+)`\n\n((?:- \w+: .*\n)+)", DOC, flags=re.MULTILINE)


def documented(body: str, label: str) -> set[str]:
    """The backticked names of one ``- label: ...`` line of a contract's section."""
    line = re.search(rf"^- {label}: (.*)$", body, flags=re.MULTILINE)
    return set(re.findall(r"`(\w+)`", line.group(1))) if line else set()


def public_members(cls: type) -> set[str]:
    """Names a plugin implements or may override: the public attributes the contract
    class (and its servelab bases) define, not those it inherits from ``object`` or
    ``torch.nn.Module``."""
    base = nn.Module if issubclass(cls, nn.Module) else object
    own = cls.__mro__[:cls.__mro__.index(base)]
    return {n for klass in own for n in [*vars(klass), *getattr(klass, "__annotations__", {})]
            if not n.startswith("_")}


def test_every_contract_is_documented():
    assert {name for name, _, _ in CONTRACTS} == {"Scheduler", "KVCacheManager", "AttentionBackend",
                                                 "DecodingStrategy", "CausalLM", "EvictionPolicy", "Executor",
                                                 "CostModel", "Router", "KVTransfer", "SchedulingPolicy", "KVTier",
                                                 "LoRAStore"}


@pytest.mark.parametrize("name,path,body", CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_documented_members_match_the_contract(name, path, body):
    module, _, attribute = path.rpartition(".")
    cls = getattr(importlib.import_module(module), attribute)
    assert cls.__name__ == name
    required, optional = documented(body, "required"), documented(body, "optional")
    attributes = documented(body, "attributes")
    abstract = {n for n in cls.__abstractmethods__ if not n.startswith("__")}
    assert required == abstract, f"{name}: documented required {sorted(required)}, abstract {sorted(abstract)}"
    assert not optional & abstract, f"{name}: optional members that are abstract: {sorted(optional & abstract)}"
    assert required | optional | attributes == public_members(cls), (
        f"{name}: undocumented {sorted(public_members(cls) - required - optional - attributes)}, "
        f"documented but absent {sorted((required | optional | attributes) - public_members(cls))}")


def test_plugin_api_version_is_documented():
    from servelab import PLUGIN_API_VERSION

    assert f"(now `{PLUGIN_API_VERSION}`)" in DOC
    major = int(PLUGIN_API_VERSION.split(".")[0])
    assert f'SERVELAB_PLUGIN_API = ">={PLUGIN_API_VERSION},<{major + 1}"' in DOC


CONTEXTS = {"SchedulerContext": "servelab.core.scheduler", "CacheContext": "servelab.core.kv_cache",
            "AttentionSpec": "servelab.core.attention", "DecodingContext": "servelab.core.decoding",
            "ExecutorContext": "servelab.core.executor", "CostModelContext": "servelab.core.cost_model",
            "RouterContext": "servelab.core.router", "KVTransferContext": "servelab.core.kv_transfer",
            "PolicyContext": "servelab.core.policy", "LoRAStoreContext": "servelab.core.lora_store"}


def documented_signature(name: str) -> list[str]:
    """The argument names of the backticked ``name(a, b, ...)`` in docs/plugins.md (the
    same wherever it appears)."""
    (arguments,) = set(re.findall(rf"`{name}\(([^)]*)\)`", DOC))
    return [argument.strip() for argument in arguments.split(",")]


@pytest.mark.parametrize("name", sorted(CONTEXTS))
def test_documented_contexts_list_their_fields(name):
    fields = [f.name for f in dataclasses.fields(getattr(importlib.import_module(CONTEXTS[name]), name))]
    assert documented_signature(name) == fields


def test_documented_model_constructor_matches_the_contract():
    from servelab.core.model import CausalLM

    (built_as,) = re.findall(r"`cls\((hf_config[^)]*)\)`", DOC)
    assert [a.strip() for a in built_as.split(",")] == list(inspect.signature(CausalLM.__init__).parameters)[1:]
