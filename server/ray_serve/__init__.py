"""``servelab-serve server.backend=ray``: engine replicas on Ray Serve behind one HTTP
ingress (``app.build_app``; docs/parallel.md). Needs the ``ray`` extra."""
