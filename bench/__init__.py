"""servelab-bench: workloads, targets, metrics, sweeps and capacity search for measuring
servelab (and baselines) the way the serving papers do. See docs/bench.md."""
