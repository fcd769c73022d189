"""Who a request serves and how urgently: its priority, tenant, deadline and SLO class."""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelab.core.errors import InvalidRequestError

PRIORITY_LIMIT = 1000
"""A priority is an integer in [-PRIORITY_LIMIT, PRIORITY_LIMIT]."""
TENANT_MAX_CHARS = 128
"""The longest tenant name."""
DEFAULT_TENANT = "default"
"""The tenant of a request that names none."""


@dataclass(frozen=True, slots=True)
class RequestMetadata:
    """What scheduling policies (``policy=...``) know of a request besides its tokens.

    ``priority``: an integer in [-1000, 1000]; lower is served first (as vLLM's
    ``priority``), 0 by default. ``tenant``: who the request is for (the OpenAI ``user``
    field), 1 to 128 characters; None counts as the tenant ``default``. ``deadline``: when
    the whole response is due, in seconds since the Unix epoch (``time.time()``); it must
    lie in the future when the request arrives. ``slo_class``: one of the engine's
    ``slo_classes`` (targets for the first token and each next one). Each field is checked
    on construction: ``InvalidRequestError`` names the field and its limit.
    """

    priority: int = 0
    tenant: str | None = None
    deadline: float | None = None
    slo_class: str | None = None

    def __post_init__(self) -> None:
        priority = self.priority
        if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > PRIORITY_LIMIT:
            raise InvalidRequestError("priority", f"must be an integer in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}] "
                                                  f"(lower is served first), got {priority!r}")
        tenant = self.tenant
        if tenant is not None and (not isinstance(tenant, str) or not 1 <= len(tenant) <= TENANT_MAX_CHARS
                                   or not tenant.isprintable()):
            raise InvalidRequestError("tenant", f"must be a printable string of 1 to {TENANT_MAX_CHARS} characters, "
                                                f"got {tenant!r}")
        deadline = self.deadline
        if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)
                                     or not math.isfinite(deadline)):
            raise InvalidRequestError("deadline", f"must be a time in seconds since the Unix epoch, got {deadline!r}")
        if self.slo_class is not None and (not isinstance(self.slo_class, str) or not self.slo_class):
            raise InvalidRequestError("slo_class", f"must be the name of an SLO class, got {self.slo_class!r}")

    @property
    def tenant_name(self) -> str:
        """The tenant, ``default`` when none was given."""
        return self.tenant if self.tenant is not None else DEFAULT_TENANT


NO_METADATA = RequestMetadata()
"""The metadata of a request that gives none: priority 0, the default tenant, no deadline."""
