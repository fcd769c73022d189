"""servelab's built-in plugins, one folder per component kind."""
