"""servelab core: contracts, registry, engine loop, model runner and entry points."""
