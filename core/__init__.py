"""servelab core. This folder holds the contracts: the component interfaces (scheduler, KV
cache, attention, decoding, executor, model, eviction, cost model, router), the hookspecs
and plugin API, and the types the engine hands to plugins (requests, contexts, step
inputs, outputs, sampling parameters, clock). ``engine/`` runs them; ``entrypoints/`` is
what users call. Imports go one way: entry points -> engine -> contracts."""
