"""Prometheus metrics of one served engine, named ``servelab:*`` in their own registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelab.core.kv_cache import KVCacheUsage
from servelab.core.outputs import RequestOutput
from servelab.core.policy import SLOClass
from servelab.core.request_metadata import DEFAULT_TENANT, RequestMetadata

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Seconds; from sub-millisecond CPU decode steps to long queued requests."""


DEFAULT_MAX_TENANT_LABELS = 16
"""``server.max_tenant_labels``: how many tenants get a label value of their own."""
OTHER_TENANT = "other"
"""The label value of the tenants seen after the first ``limit``."""


class TenantLabels:
    """Maps tenant names to label values: themselves for the first ``limit`` distinct
    tenants (in the order first seen, for the server's life), ``other`` after. Clients
    name tenants (``user``, ``X-Servelab-Tenant``), so a label per tenant would let them
    create time series without end."""

    def __init__(self, limit: int):
        self.limit = limit
        self._named: set[str] = set()

    def label(self, tenant: str | None) -> str:
        """The label value of ``tenant`` (None: the default tenant, which takes no slot)."""
        if tenant is None or tenant == DEFAULT_TENANT:
            return DEFAULT_TENANT
        if tenant in self._named:
            return tenant
        if len(self._named) < self.limit:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANT


@dataclass(frozen=True, slots=True)
class RequestLabels:
    """What the metrics of one engine request are labelled by: its ``tenant`` label value
    and its SLO class (None: none)."""

    tenant: str
    slo_class: str | None = None


UNTRACKED = RequestLabels(DEFAULT_TENANT)
"""The labels of a request the metrics were not told of (``track``)."""


class ServerMetrics:
    """Histograms, gauges and counters of the engine behind the server.

    Each engine request is ``track``ed when it is added: its metrics are labelled by its
    ``tenant`` (``TenantLabels``: at most ``max_tenant_labels`` tenants get their own
    value, later ones ``other``, a request naming none ``default``). Generated tokens are
    counted from each delta output (``record_output``), latencies observed when a request
    finishes; gauges are set after every engine-loop iteration (``set_gauges``; KV usage
    is computed from the latest occupancy when scraped), the preemption counter from each
    step's ``StepStats`` (``observe_step``); the engine process reports both.
    The server's backpressure counts calls it rejected (``rejected``) or timed out
    (``timed_out``).
    Counters for prefix cache hits and speculative decoding exist only when the engine
    uses those features, the SLO attainment counter only when it has ``slo_classes``, the
    LoRA adapter slots' gauges (summed over the engine instances) only with ``lora``.
    """

    def __init__(self, prefix_caching: bool = False, speculative: bool = False,
                 max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS, slo_classes: Mapping[str, SLOClass] | None = None,
                 lora: bool = False):
        self.registry = CollectorRegistry()
        r = self.registry
        self.tenants = TenantLabels(max_tenant_labels)
        self.slo_classes = dict(slo_classes or {})
        self._tracked: dict[str, RequestLabels] = {}
        tenant = ["tenant"]
        self.ttft = Histogram("servelab:time_to_first_token_seconds", "Time to first token.", tenant,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("servelab:inter_token_latency_seconds", "Gap between consecutive output tokens "
                             "of a sequence (n=1 requests).", tenant, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("servelab:e2e_request_latency_seconds", "Arrival to last token.", tenant,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("servelab:request_queue_time_seconds", "Arrival to first scheduling.", tenant,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("servelab:num_requests_running", "Sequences holding KV cache.", registry=r)
        self.waiting = Gauge("servelab:num_requests_waiting", "Sequences queued (new or preempted).", registry=r)
        self.kv_usage = Gauge("servelab:kv_cache_usage_perc", "Fraction of KV cache slots held by live "
                              "requests (0 to 1).", registry=r)
        self._kv: KVCacheUsage | None = None
        self.kv_usage.set_function(lambda: self._kv.usage if self._kv is not None else 0.0)
        self.prompt_tokens = Counter("servelab:prompt_tokens", "Prompt tokens of accepted requests.", tenant,
                                     registry=r)
        self.generation_tokens = Counter("servelab:generation_tokens", "Generated tokens.", tenant, registry=r)
        self.preemptions = Counter("servelab:num_preemptions", "Sequences preempted.", registry=r)
        self.success = Counter("servelab:request_success", "Finished sequences by finish reason "
                               "(stop, length, abort, deadline).", ["finished_reason", "tenant"], registry=r)
        self.slo = None
        if self.slo_classes:
            self.slo = Counter("servelab:slo_requests", "Finished requests of an SLO class, by whether they met "
                               "its targets (outcome attained or missed).", ["slo_class", "tenant", "outcome"],
                               registry=r)
        self.rejected = Counter("servelab:num_requests_rejected", "API calls answered 429 because the server "
                                "held server.max_queued_requests requests.", registry=r)
        self.timed_out = Counter("servelab:num_requests_timed_out", "API calls aborted after "
                                 "server.request_timeout_s.", registry=r)
        self.prefix_hits = self.spec_proposed = self.spec_accepted = None
        if prefix_caching:
            self.prefix_hits = Counter("servelab:prefix_cache_hit_tokens", "Prompt tokens found in the "
                                       "prefix cache.", registry=r)
        self._lora: dict[int, Any] = {}
        if lora:
            self._lora_gauge("servelab:lora_adapter_hit_rate", "Share of the adapter uses by steps that found the "
                             "adapter in a slot (0 to 1).", lambda hits, misses, seconds, resident:
                             hits / (hits + misses) if hits + misses else 0.0)
            self._lora_gauge("servelab:lora_adapter_loads", "Adapters paged into a slot so far.",
                             lambda hits, misses, seconds, resident: misses)
            self._lora_gauge("servelab:lora_adapter_load_seconds", "Seconds spent paging adapters into slots so far.",
                             lambda hits, misses, seconds, resident: seconds)
            self._lora_gauge("servelab:lora_adapters_resident", "Adapters held in slots now.",
                             lambda hits, misses, seconds, resident: resident)
        if speculative:
            self.spec_proposed = Counter("servelab:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         registry=r)
            self.spec_accepted = Counter("servelab:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                         registry=r)

    def _lora_gauge(self, name: str, description: str, value: Any) -> None:
        """A gauge of ``value(hits, misses, load seconds, resident)`` summed over the instances."""
        def read() -> float:
            stats = self._lora.values()
            return value(sum(s.hits for s in stats), sum(s.misses for s in stats), sum(s.load_seconds for s in stats),
                         sum(s.resident for s in stats))

        Gauge(name, description, registry=self.registry).set_function(read)

    def set_lora(self, instance: int, stats: Any) -> None:
        """Engine instance ``instance``'s latest ``LoRAStats``."""
        self._lora[instance] = stats

    def track(self, request_id: str, metadata: RequestMetadata) -> str:
        """Label the metrics of the engine request ``request_id`` (being added) by its
        tenant and SLO class; returns its tenant label value."""
        labels = RequestLabels(self.tenants.label(metadata.tenant), metadata.slo_class)
        self._tracked[request_id] = labels
        return labels.tenant

    def forget(self, request_id: str) -> None:
        """Drop the labels of a request the engine refused or failed."""
        self._tracked.pop(request_id, None)

    def observe_step(self, stats: Any) -> None:
        """Add one step's ``StepStats`` to the counters."""
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

    def record_output(self, output: RequestOutput) -> None:
        """Count a delta output's generated tokens; when it finishes the request, observe
        its latencies, one success count per sequence and whether it met its SLO class."""
        labels = (self._tracked.pop if output.finished else self._tracked.get)(output.request_id, UNTRACKED)
        tenant = labels.tenant
        generated = sum(len(completion.token_ids) for completion in output.outputs)
        if generated:
            self.generation_tokens.labels(tenant=tenant).inc(generated)
        if not output.finished:
            return
        m = output.metrics
        for value, histogram in ((m.ttft, self.ttft), (m.e2e_latency, self.e2e), (m.queue_time, self.queue)):
            if value is not None:
                histogram.labels(tenant=tenant).observe(value)
        if len(output.outputs) == 1:
            itl = self.itl.labels(tenant=tenant)
            for gap in m.inter_token_latencies:
                itl.observe(gap)
        for completion in output.outputs:
            self.success.labels(finished_reason=completion.finish_reason or "abort", tenant=tenant).inc()
        if self.slo is not None and labels.slo_class is not None:
            attained = self.slo_classes[labels.slo_class].attained(m.ttft, m.tpot)
            self.slo.labels(slo_class=labels.slo_class, tenant=tenant,
                            outcome="attained" if attained else "missed").inc()

    def record_aborted(self, request_ids: Iterable[str]) -> None:
        """Count sequences aborted by a client disconnect, a timeout or shutdown (one
        request id per sequence)."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self.success.labels(finished_reason="abort", tenant=self._tracked.get(request_id, UNTRACKED).tenant).inc()
        for request_id in request_ids:
            self.forget(request_id)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
