"""The built-in adapter stores' own rules (the kit, tests/conformance, checks the contract):
``directory`` serves only folders under its root, ``local`` needs a folder, and a bad
``lora.store`` or ``lora.store_path`` is a ``ConfigError`` naming it."""

from __future__ import annotations

import os

import pytest

from servelab.core.engine.registry import get_registry
from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.lora_store import LoRAStoreContext, open_lora_store
from servelab.core.config import LoRAConfig
from servelab.testing.lora_store_kit import write_peft_adapter


def store(name: str, location: str | None):
    return open_lora_store(LoRAConfig(store=name, store_path=location), get_registry())


def refused(store_, name: str, path: str | None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as error:
        store_.fetch(name, path)
    return error.value


def test_directory_serves_only_adapter_folders_under_its_root(tmp_path):
    root = tmp_path / "root"
    write_peft_adapter(str(root / "kept"), 2, ("self_attn.q_proj",), 1)
    write_peft_adapter(str(tmp_path / "outside"), 2, ("self_attn.q_proj",), 1)
    (root / "empty").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    directory = store("directory", str(root))
    assert directory.available() == ["kept"]
    assert directory.fetch("kept", None).source == str(root / "kept")
    assert directory.fetch("other-name", "kept").source == str(root / "kept")
    for name in ("../outside", "link/..", "a/b", "..", "link"):
        assert refused(directory, name, None).field == "lora_name", name
    unknown = refused(directory, "nope", None)
    assert unknown.field == "lora_name" and "serves: kept" in str(unknown)
    for path in (str(tmp_path / "outside"), "../outside", "link", "/"):
        error = refused(directory, "x", path)
        assert error.field == "lora_path" and "outside lora.store_path" in str(error), path


def test_local_needs_a_folder_and_lists_nothing(tmp_path):
    local = store("local", None)
    assert local.available() == []
    assert refused(local, "a", None).field == "lora_path"
    write_peft_adapter(str(tmp_path / "a"), 2, ("self_attn.q_proj",), 1)
    assert local.fetch("a", str(tmp_path / "a")).source == str(tmp_path / "a")


def test_bad_store_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="lora_store.*'nowhere'.*directory.*local"):
        store("nowhere", None)
    for location in (None, str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match="lora.store=directory .* set it to a folder"):
            get_registry().get("lora_store", "directory").cls(LoRAStoreContext(location))
