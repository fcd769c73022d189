"""The FastAPI application: routes, API-key and model checks, draining, and the engine's
lifespan (the handlers' shared state is ``server/state.py``)."""

from __future__ import annotations

import hmac
import importlib.metadata
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from servelab.core.errors import InvalidRequestError
from servelab.server.chat import create_chat_completion
from servelab.server.chat_template import render_chat
from servelab.server.completions import create_completion
from servelab.server.errors import RESPONSES, APIError, install_error_handlers, shutting_down
from servelab.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
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


def check_model(state: ServerState, name: str | None) -> None:
    """404 unless ``name`` is the served model (or omitted)."""
    if name is not None and name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")


guarded = APIRouter(dependencies=[Depends(accepting), Depends(authorized)])


@guarded.post("/v1/completions", responses=RESPONSES)
async def completions(body: CompletionRequest, request: Request):
    """Text completion (OpenAI ``/v1/completions``)."""
    state = _state(request)
    check_model(state, body.model)
    return await create_completion(body, request, state)


@guarded.post("/v1/chat/completions", responses=RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Chat completion (OpenAI ``/v1/chat/completions``)."""
    state = _state(request)
    check_model(state, body.model)
    return await create_chat_completion(body, request, state)


@guarded.get("/v1/models")
async def models(request: Request) -> dict:
    """The served model."""
    state = _state(request)
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "servelab",
        "max_model_len": state.engine.engine.max_model_len}]}


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
