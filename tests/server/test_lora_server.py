"""LoRA adapters over HTTP: loaded and unloaded at run time (vLLM's endpoints), by folder
or, from the ``directory`` store, by name alone; listed by ``/v1/models``, selected by
the request's ``model``; an unknown one is a 404 like an unknown model; the adapter
slots' paging in ``/metrics``."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_process import ServerProcess

from servelab import LLM, SamplingParams
from servelab.testing import tiny_checkpoint

pytest.importorskip("peft")
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A server of a tiny Llama serving the adapter folders under one root
    (``lora.store=directory``), adapter ``a`` loaded by name at start-up; the folder of a
    second adapter ``b``; the offline engine with both, the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_server")
    base = tiny_checkpoint(root / "base")
    folders = {}
    for seed, (name, targets) in enumerate((("a", ["q_proj", "v_proj"]), ("b", ["o_proj", "down_proj"])), 1):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        folders[name] = str(root / name)
        model.save_pretrained(folders[name])
    engine = ("model=local", f"model.path='{base}'", "model.dtype=float32", "lora.store=directory",
              f"lora.store_path='{root}'", "lora.adapters={a: null}", "lora.max_adapters=1")
    proc = ServerProcess(root / "server.log", "server.served_model_name=base", engine=engine)
    offline = LLM(base, overrides=["model.dtype=float32", "device=cpu",
                                   f"lora.adapters={{a: '{folders['a']}', b: '{folders['b']}'}}"])
    yield proc, folders, offline
    proc.stop()


def complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def test_adapters_load_list_select_and_unload(lora_server):
    proc, folders, offline = lora_server
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = {name: offline.generate([PROMPT], params, use_tqdm=False, lora=name)[0].outputs[0].text
                for name in ("a", "b", None)}
    assert len(set(expected.values())) == 3
    with httpx.Client(base_url=proc.url, timeout=120) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base", "a"]
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]}).status_code == 200
        listed = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [("base", None), ("a", "base"), ("b", "base")]
        for name in ("a", "b", "base"):
            answer = complete(http, name).json()
            assert answer["model"] == name
            assert answer["choices"][0]["text"] == expected[None if name == "base" else name], name
        chat = http.post("/v1/chat/completions", json={"model": "b", "max_tokens": 4, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "b"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        gone = complete(http, "b")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert "`a`" in gone.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "b"}).status_code == 200
        assert [m["root"] for m in http.get("/v1/models").json()["data"]][2] == folders["b"]
        assert complete(http, "b").json()["choices"][0]["text"] == expected["b"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        unknown = http.post("/v1/load_lora_adapter", json={"lora_name": "zzz"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_name"
        outside = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/"})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "lora_path"
        twice = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": folders["a"]})
        assert twice.status_code == 400 and "already been loaded" in twice.json()["error"]["message"]
        not_adapter = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(proc.log_path)})
        assert not_adapter.status_code == 400 and not_adapter.json()["error"]["param"] == "lora_path"
        assert complete(http, "a").json()["choices"][0]["text"] == expected["a"]
        metrics = {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
                   if line.startswith("servelab:lora_")}
        assert metrics["servelab:lora_adapter_loads"] >= 3  # one slot: a, b, then a again
        assert 0 < metrics["servelab:lora_adapter_hit_rate"] < 1 and metrics["servelab:lora_adapter_load_seconds"] > 0
        assert metrics["servelab:lora_adapters_resident"] == 1
