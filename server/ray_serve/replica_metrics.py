"""One Prometheus exposition of several engine replicas' metrics, told apart by label.

Each replica keeps its own ``ServerMetrics``; the ingress of ``server.backend=ray`` asks
every replica for its exposition and serves them together at ``/metrics``, every sample
labelled ``replica="<id>"``. Totals over replicas are a query away:
``sum without (replica) (servelab:generation_tokens_total)``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Families:
    """A collector over already-built metric families (what ``generate_latest`` reads)."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> list[Metric]:
        """The families, as they are."""
        return self.families


def label_replicas(expositions: Mapping[str, bytes]) -> bytes:
    """The text expositions of ``{replica id: exposition}`` merged into one, each sample
    carrying ``replica="<id>"``; a family shared by several replicas appears once."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(expositions.items()):
        for family in text_string_to_metric_families(text.decode()):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                         family.unit))
            into.samples += [s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples]
    return generate_latest(_Families(merged.values()))
