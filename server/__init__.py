"""servelab's OpenAI-compatible HTTP server (``servelab-serve``).

One ``LLMEngine`` runs on a dedicated thread (``AsyncEngine``); FastAPI handlers feed it
requests and stream its outputs back as server-sent events. See ``docs/server.md``.
"""
