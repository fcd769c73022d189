"""Every console script with its defaults, as a new user runs it after the README's install:
``servelab-serve`` on every shipped model preset and on no overrides at all, and
``servelab-bench`` in process and over HTTP against that default server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, console_script

from servelab.core.config import checkpoint_path

PRESETS = {"tiny": (), "tiny-draft": (), "toy": (), "local": ("model.path=${servelab_checkpoint:tiny}",)}
"""Every file in conf/model with the overrides it needs (``local`` takes a folder)."""


def complete(url: str) -> dict:
    """One greedy completion through the server's OpenAI endpoint."""
    response = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def shipped_presets() -> dict[str, dict]:
    """Every file in conf/model, by name, as loaded."""
    import servelab.conf
    from omegaconf import OmegaConf

    folder = Path(servelab.conf.__file__).parent / "model"
    return {p.stem: OmegaConf.to_container(OmegaConf.load(p)) for p in folder.glob("*.yaml")}


def simulation_only(preset: dict) -> bool:
    """A shape without weights: only ``executor=simulated`` runs it (tests/sim covers those)."""
    shape = preset.get("shape") or {}
    return bool(shape) and not shape.get("random_weights")


def test_every_servable_model_preset_is_tested():
    servable = {name for name, preset in shipped_presets().items() if not simulation_only(preset)}
    assert servable == set(PRESETS)


def test_simulation_presets_refuse_to_serve_with_a_clear_error():
    name = next(name for name, preset in sorted(shipped_presets().items()) if simulation_only(preset))
    result = subprocess.run([console_script("servelab"), f"model={name}"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert "has no weights" in result.stderr and "executor=simulated" in result.stderr


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "tiny"])
def test_serve_answers_on_preset(tmp_path, preset):
    server = ServerProcess(tmp_path / "server.log", engine=(f"model={preset}", *PRESETS[preset]),
                           command=(console_script("servelab-serve"),))
    try:
        body = complete(server.url)
        assert body["usage"]["completion_tokens"] == 4
        assert body["model"] == (checkpoint_path("tiny") if preset == "local" else preset)
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """``servelab-serve`` with no overrides but its port: the default model, ``tiny``."""
    server = ServerProcess(tmp_path_factory.mktemp("default") / "server.log", engine=(),
                           command=(console_script("servelab-serve"),))
    yield server
    assert server.stop() == 0, server.log()


def test_serve_defaults_answer(default_server):
    body = complete(default_server.url)
    assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 4


def run_bench(tmp_path, *overrides: str) -> dict:
    """``servelab-bench`` in ``tmp_path``; its metrics.json."""
    result = subprocess.run([console_script("servelab-bench"), "use_tqdm=false", *overrides], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = tmp_path.glob("outputs/bench/*/*/metrics.json")
    return json.loads(path.read_text())


def test_bench_defaults_inproc(tmp_path):
    metrics = run_bench(tmp_path)
    assert metrics["system"]["name"] == "servelab"
    assert (metrics["num_completed"], metrics["num_failed"]) == (32, 0)


def test_bench_defaults_over_http(tmp_path, default_server):
    metrics = run_bench(tmp_path, "target=http", f"target.url={default_server.url}")
    assert metrics["system"]["name"] == "http"
    assert (metrics["num_completed"], metrics["num_failed"]) == (32, 0)
