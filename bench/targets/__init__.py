"""Systems under test reached through servelab: the in-process engine or an HTTP server."""
