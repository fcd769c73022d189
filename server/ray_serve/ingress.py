"""The ingress of ``servelab-serve server.backend=ray``: the deployment behind Ray Serve's
HTTP proxy that hands every request to an engine replica and gathers their metrics.

It reads the request, and with ``server.routing=router`` the prompt's tokens
(``routing_prompt``), then calls one ``EngineReplica`` through a streaming Ray Serve
handle: Ray Serve's router (``routing=ray``) or ``PluginRequestRouter`` picks the replica.
Event streams are relayed chunk by chunk; other responses whole, so a replica that dies
mid-request still gets a proper 503 answered. ``/metrics`` is every replica's exposition,
labelled ``replica`` (``replica_metrics``).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from omegaconf import DictConfig
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from servelab.server.errors import APIError, install_error_handlers
from servelab.server.ray_serve.forwarded_request import ForwardedRequest
from servelab.server.ray_serve.replica_metrics import label_replicas
from servelab.server.ray_serve.routing_prompt import routing_prompt
from servelab.server.output_stream import DONE, sse

REPLICA_GONE = (RayActorError, ActorUnavailableError)
"""What a handle raises when the replica serving the call died or cannot be reached."""

METRICS_TIMEOUT_S = 10.0
"""How long ``/metrics`` waits for the replicas' expositions."""

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def replica_gone(exc: BaseException) -> APIError:
    """503: the replica serving the request died; Ray Serve replaces it, others serve."""
    return APIError(503, f"the replica serving this request is gone ({type(exc).__name__}); retry",
                    "server_error", code="replica_unavailable")


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
               for name, value in headers)


@serve.ingress()
class ServelabIngress:
    """Forwards each HTTP request to an ``EngineReplica`` (``replicas``); serves the
    replicas' ``/metrics``. ``cfg``: the resolved ``servelab-serve`` configuration."""

    def __init__(self, replicas: DeploymentHandle, cfg: DictConfig):
        self.replicas = replicas
        self.streaming = replicas.options(stream=True)
        self.routes_by_prompt = cfg.server.routing == "router"
        self.tokenizer = None
        if self.routes_by_prompt:
            from servelab.core.checkpoint import load_checkpoint

            self.tokenizer = load_checkpoint(cfg.model).tokenizer

    def __serve_build_asgi_app__(self) -> FastAPI:
        """``/metrics`` here, every other path forwarded."""
        app = FastAPI(title="servelab on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/{path:path}", self.forward, methods=METHODS)
        return app

    async def forward(self, request: Request) -> Response:
        """The chosen replica's answer to ``request``."""
        body = await request.body()
        path = request.url.path
        prompt = routing_prompt(path, body, self.tokenizer) if self.routes_by_prompt else None
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     tuple(request.headers.raw), body, prompt)
        stream = self.streaming.handle_http.remote(forwarded)
        try:
            start = await stream.__anext__()
            if _is_event_stream(start["headers"]):
                response: Response = StreamingResponse(self._relay(stream), status_code=start["status"])
            else:
                content = b"".join([message.get("body", b"") async for message in stream])
                response = Response(content, status_code=start["status"])
        except REPLICA_GONE as exc:
            stream.cancel()
            raise replica_gone(exc) from exc
        except BaseException:
            stream.cancel()
            raise
        response.raw_headers = [(name, value) for name, value in start["headers"]]
        return response

    @staticmethod
    async def _relay(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes | str]:
        """The body chunks of an event stream; if the replica dies, an error event and
        ``[DONE]`` end it. Cancels the replica's work when the client goes away."""
        try:
            async for message in stream:
                if message.get("body"):
                    yield message["body"]
        except REPLICA_GONE as exc:
            yield sse(replica_gone(exc).body())
            yield DONE
        finally:
            stream.cancel()

    async def metrics(self) -> Response:
        """Every live replica's metrics, each sample labelled ``replica``."""
        results: list[Any] = await self.replicas.broadcast("metrics_text").results_async(
            timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
        expositions = dict(r for r in results if isinstance(r, tuple))
        return Response(label_replicas(expositions), media_type=CONTENT_TYPE_LATEST)
