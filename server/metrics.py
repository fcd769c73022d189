"""Prometheus metrics of one served engine, named ``servelab:*`` in their own registry."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelab.core.kv_cache import KVCacheUsage
from servelab.core.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Seconds; from sub-millisecond CPU decode steps to long queued requests."""


class ServerMetrics:
    """Histograms, gauges and counters of the engine behind the server.

    Request latencies are observed when a request finishes (``record_finished``), gauges
    after every engine-loop iteration (``set_gauges``; KV usage is computed from the
    latest occupancy when scraped), token and preemption counters
    from each step's ``StepStats`` (``observe_step``); the engine process reports both.
    The server's backpressure counts calls it rejected (``rejected``) or timed out
    (``timed_out``).
    Counters for prefix cache hits and speculative decoding exist only when the engine
    uses those features.
    """

    def __init__(self, prefix_caching: bool = False, speculative: bool = False):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("servelab:time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("servelab:inter_token_latency_seconds", "Gap between consecutive output tokens "
                             "of a sequence (n=1 requests).", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("servelab:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("servelab:request_queue_time_seconds", "Arrival to first scheduling.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("servelab:num_requests_running", "Sequences holding KV cache.", registry=r)
        self.waiting = Gauge("servelab:num_requests_waiting", "Sequences queued (new or preempted).", registry=r)
        self.kv_usage = Gauge("servelab:kv_cache_usage_perc", "Fraction of KV cache slots held by live "
                              "requests (0 to 1).", registry=r)
        self._kv: KVCacheUsage | None = None
        self.kv_usage.set_function(lambda: self._kv.usage if self._kv is not None else 0.0)
        self.prompt_tokens = Counter("servelab:prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("servelab:generation_tokens", "Generated tokens.", registry=r)
        self.preemptions = Counter("servelab:num_preemptions", "Sequences preempted.", registry=r)
        self.success = Counter("servelab:request_success", "Finished sequences by finish reason "
                               "(stop, length, abort).", ["finished_reason"], registry=r)
        self.rejected = Counter("servelab:num_requests_rejected", "API calls answered 429 because the server "
                                "held server.max_queued_requests requests.", registry=r)
        self.timed_out = Counter("servelab:num_requests_timed_out", "API calls aborted after "
                                 "server.request_timeout_s.", registry=r)
        self.prefix_hits = self.spec_proposed = self.spec_accepted = None
        if prefix_caching:
            self.prefix_hits = Counter("servelab:prefix_cache_hit_tokens", "Prompt tokens found in the "
                                       "prefix cache.", registry=r)
        if speculative:
            self.spec_proposed = Counter("servelab:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         registry=r)
            self.spec_accepted = Counter("servelab:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                         registry=r)

    def observe_step(self, stats: Any) -> None:
        """Add one step's ``StepStats`` to the counters."""
        self.generation_tokens.inc(stats.num_generated_tokens)
        self.preemptions.inc(stats.num_preempted)
        if self.prefix_hits is not None:
            self.prefix_hits.inc(getattr(stats, "prefix_hit_tokens", 0))
        if self.spec_proposed is not None:
            self.spec_proposed.inc(getattr(stats, "spec_proposed", 0))
            self.spec_accepted.inc(getattr(stats, "spec_accepted", 0))

    def set_gauges(self, num_running: int, num_waiting: int, kv: KVCacheUsage | None) -> None:
        """Running/waiting sequence counts and KV occupancy after the engine's latest step."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self._kv = kv

    def record_finished(self, output: RequestOutput) -> None:
        """Latencies of a finished request and one success count per sequence."""
        m = output.metrics
        for value, histogram in ((m.ttft, self.ttft), (m.e2e_latency, self.e2e), (m.queue_time, self.queue)):
            if value is not None:
                histogram.observe(value)
        if len(output.outputs) == 1:
            for gap in m.inter_token_latencies:
                self.itl.observe(gap)
        for completion in output.outputs:
            self.success.labels(finished_reason=completion.finish_reason or "abort").inc()

    def record_aborted(self, num_sequences: int) -> None:
        """Count sequences aborted by a client disconnect or by shutdown."""
        if num_sequences:
            self.success.labels(finished_reason="abort").inc(num_sequences)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
