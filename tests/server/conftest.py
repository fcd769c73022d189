"""A real ``servelab-serve`` on 127.0.0.1 (model=toy) and the offline reference engine."""

from __future__ import annotations

import httpx
import pytest
from server_process import API_KEY, ENGINE_OVERRIDES, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One shared server with an API key, for every test that does not stop it."""
    proc = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", f"server.api_key={API_KEY}")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def offline():
    """The offline engine on the same model: the reference for greedy results."""
    from servelab import LLM

    return LLM("toy", overrides=ENGINE_OVERRIDES[1:])


@pytest.fixture
def client(server):
    """The official OpenAI client pointed at the shared server."""
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(server):
    """A plain HTTP client for the shared server (authorized)."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def greedy(offline):
    """``greedy(prompts, max_tokens, **params)``: offline greedy (text, token ids, finish
    reason) per prompt; streamed and final text agree, so it is the reference for both."""
    from servelab import SamplingParams

    def run(prompts, max_tokens: int, **params) -> list[tuple[str, list[int], str]]:
        outputs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                                   use_tqdm=False)
        return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]

    return run
