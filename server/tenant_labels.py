"""The ``tenant`` label of the server's metrics, with bounded cardinality.

Tenants are named by clients (``user``, ``X-Servelab-Tenant``), so a label per tenant
would let them create time series without end. The first ``limit`` distinct tenants seen
keep their name as the label value; every later one is counted as ``other``. A request
that names no tenant is ``default``, which takes no slot.
"""

from __future__ import annotations

from servelab.core.request_metadata import DEFAULT_TENANT

DEFAULT_MAX_TENANT_LABELS = 16
"""``server.max_tenant_labels``: how many tenants get a label value of their own."""
OTHER_TENANT = "other"
"""The label value of the tenants seen after the first ``limit``."""


class TenantLabels:
    """Maps tenant names to label values: themselves for the first ``limit`` distinct
    tenants (in the order first seen, for the server's life), ``other`` after."""

    def __init__(self, limit: int):
        self.limit = limit
        self._named: set[str] = set()

    def label(self, tenant: str) -> str:
        """The label value of ``tenant`` (its name from ``RequestMetadata.tenant_name``)."""
        if tenant == DEFAULT_TENANT or tenant in self._named:
            return tenant
        if len(self._named) < self.limit:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANT
