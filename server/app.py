"""The FastAPI application: routes, API-key and model checks, draining, and the engine's
lifespan (the handlers' shared state is ``server/state.py``)."""

from __future__ import annotations

import hmac
import importlib.metadata
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from servelab.core.errors import InvalidRequestError
from servelab.server.chat import create_chat_completion
from servelab.server.chat_template import render_chat
from servelab.server.completions import create_completion
from servelab.server.errors import RESPONSES, APIError, install_error_handlers, shutting_down
from servelab.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from servelab.server.state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.servelab


def accepting(request: Request) -> None:
    """503 while the server drains."""
    if _state(request).draining:
        raise shutting_down()


def authorized(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <server.api_key>`` (when set)."""
    key = _state(request).config.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                       code="invalid_api_key")


def check_model(state: ServerState, name: str | None) -> str | None:
    """The LoRA adapter ``name`` selects (None: the served model, or omitted); 404 when it
    names neither the served model nor a loaded adapter."""
    if name is None or name == state.model_name:
        return None
    if name in state.engine.lora_adapters:
        return name
    adapters = "".join(f", `{a}`" for a in sorted(state.engine.lora_adapters))
    raise APIError(404, f"The model `{name}` does not exist; this server serves `{state.model_name}`{adapters}.",
                   param="model", code="model_not_found")


guarded = APIRouter(dependencies=[Depends(accepting), Depends(authorized)])


@guarded.post("/v1/completions", responses=RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    """Text completion (OpenAI ``/v1/completions``)."""
    state = _state(request)
    return await create_completion(body, request, state, check_model(state, body.model))


@guarded.post("/v1/chat/completions", responses=RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Chat completion (OpenAI ``/v1/chat/completions``)."""
    state = _state(request)
    return await create_chat_completion(body, request, state, check_model(state, body.model))


@guarded.get("/v1/models")
async def models(request: Request) -> dict:
    """The served model, then its LoRA adapters (``parent``: the served model)."""
    state = _state(request)
    common = {"object": "model", "created": state.created, "owned_by": "servelab",
              "max_model_len": state.engine.engine.max_model_len}
    return {"object": "list", "data": [{"id": state.model_name, **common, "root": state.model_name, "parent": None}] + [
        {"id": name, **common, "root": path, "parent": state.model_name}
        for name, path in sorted(state.engine.lora_adapters.items())]}


@guarded.post("/v1/load_lora_adapter", responses=RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Serve an adapter under a name (``model`` selects it), as vLLM does: the PEFT folder
    ``lora_path``, or with only ``lora_name`` the adapter store's adapter of that name."""
    state = _state(request)
    if body.lora_name == state.model_name or body.lora_name in state.engine.lora_adapters:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
    await state.engine.update_lora(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@guarded.post("/v1/unload_lora_adapter", responses=RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving an adapter (requests already running finish with it), as vLLM does."""
    state = _state(request)
    if body.lora_name not in state.engine.lora_adapters:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "not_found_error",
                       param="lora_name", code="model_not_found")
    await state.engine.update_lora(body.lora_name, None, load=False)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@guarded.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """Token ids of a prompt, or of a conversation rendered with the chat template."""
    state = _state(request)
    check_model(state, body.model)
    body.check()

    def encode(engine) -> list[int]:
        if engine.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer")
        text = body.prompt if body.messages is None else render_chat(engine.tokenizer, body.messages,
                                                                     body.add_generation_prompt)
        return engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    tokens = await state.engine.call(encode)
    return {"count": len(tokens), "max_model_len": state.engine.engine.max_model_len, "tokens": tokens}


@guarded.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """Text of token ids."""
    state = _state(request)
    check_model(state, body.model)

    def decode(engine) -> str:
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise InvalidRequestError("tokens", f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})")
        if engine.tokenizer is None:
            raise InvalidRequestError("tokens", "this model has no tokenizer")
        return engine.tokenizer.decode(body.tokens)

    return {"prompt": await state.engine.call(decode)}


open_routes = APIRouter()


@open_routes.get("/health")
async def health(request: Request) -> Response:
    """200 while serving; 503 while draining or after the engine failed."""
    state = _state(request)
    if state.draining:
        raise shutting_down()
    if state.engine.dead is not None:
        raise APIError(503, f"the engine loop failed: {state.engine.dead!r}", "server_error", code="engine_dead")
    return Response(status_code=200)


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(_state(request).engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@open_routes.get("/version")
async def version() -> JSONResponse:
    """servelab's version."""
    return JSONResponse({"version": importlib.metadata.version("servelab")})


def create_app(state: ServerState) -> FastAPI:
    """The application over ``state``; its lifespan starts receiving from the engine and, at
    shutdown, drains (``server.drain_timeout_s``) and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await state.drain(state.config.drain_timeout_s)
        await state.engine.stop()

    app = FastAPI(title="servelab", version=importlib.metadata.version("servelab"), lifespan=lifespan)
    app.state.servelab = state
    install_error_handlers(app)
    app.include_router(guarded)
    app.include_router(open_routes)
    return app
