"""servelab's OpenAI-compatible HTTP server (``servelab-serve``).

One ``LLMEngine`` runs in a process of its own (``EngineProcess``), driven through a pipe
from the event loop (``AsyncEngine``); FastAPI handlers feed it requests and stream its
outputs back as server-sent events. ``server.backend=ray`` serves several such engines as
Ray Serve replicas (``ray_serve.app``). See ``docs/server.md`` and ``docs/parallel.md``.
"""
