"""The daemon's one tenant table: a request's (tenant, priority, ttft_slo_ms) fields ->
:class:`fulcrum.core.tenants.RequestClass`, at the service boundary of Submit,
PlaceDecode and PlaceImages (issue 23).

One :class:`Tenancy` per daemon (``app.components["tenants"]``), shared by the three
balancers so that a tenant is one fairness id and one bounded metric label everywhere.
Validation raises :class:`fulcrum.errors.InvalidArgument` naming the field (tenant over
``tenants.max_tenant_length`` or not printable, priority outside
``tenants.min_priority .. max_priority``, ttft_slo_ms past one day) before any state
changes; the distinct tenant past ``tenants.max_tenants`` is folded into the default
class and counted (``fulcrum_tenant_folded``), never a new label. Event loop only.
"""

from __future__ import annotations

from typing import Protocol

import structlog

from fulcrum.config import Settings
from fulcrum.config.tenants import TenantsSettings
from fulcrum.core.tenants import RequestClass, TenantTable
from fulcrum.errors import InvalidArgument
from fulcrum.metrics import tenants as tm
from fulcrum.service.app import App

log = structlog.get_logger(__name__)

_KEY = "tenants"


class ClassFields(Protocol):
    """The class fields every entry point's request message carries."""

    tenant: str
    priority: int

    ttft_slo_ms: int

    def HasField(self, name: str) -> bool: ...


class Tenancy:
    """Resolves requests' class fields through one bounded :class:`TenantTable`."""

    def __init__(self, settings: TenantsSettings) -> None:
        self.table = TenantTable(settings.to_policy())
        self._folded_logged = False
        self._default = self.table.resolve()

    def apply_settings(self, settings: TenantsSettings) -> None:
        """Reload: the new policy applies to the next request (tracked tenants stay)."""
        self.table.apply(settings.to_policy())
        self._default = self.table.resolve()
        tm.TRACKED.set(self.table.tracked)

    def resolve(self, tenant: str, priority: int, ttft_slo_ms: int | None) -> RequestClass:
        """The class of a request's fields (``ttft_slo_ms``: ms, None = not given);
        ``InvalidArgument`` naming the field, counted, when one breaks its rule."""
        folded = self.table.folded
        try:
            rc = self.table.resolve(tenant, int(priority), ttft_slo_ms)
        except InvalidArgument as err:
            tm.INVALID.labels(err.field if err.field in tm.FIELDS else "tenant").inc()
            raise
        if self.table.folded != folded:
            tm.FOLDED.inc()
            if not self._folded_logged:  # one line per state change: the table is full
                self._folded_logged = True
                log.info("tenants_table_full", max_tenants=self.table.policy.max_tenants,
                         tracked=self.table.tracked)
        else:
            tm.TRACKED.set(self.table.tracked)
        return rc

    def of(self, request: ClassFields) -> RequestClass:
        """The class of a request message (SubmitRequest, PlaceDecodeRequest,
        PlaceImagesRequest). A request naming nothing takes the fast path (no lookup)."""
        has_ttft = request.HasField("ttft_slo_ms")
        if not (request.tenant or request.priority or has_ttft):
            return self._default
        ttft = int(request.ttft_slo_ms) if has_ttft else None
        return self.resolve(request.tenant, request.priority, ttft)

    def label(self, rc: RequestClass) -> str:
        """The bounded metric label of ``rc``'s tenant."""
        return self.table.label(rc.tenant)


def tenancy_of(app: App) -> Tenancy:
    """The daemon's :class:`Tenancy`, made on first use (with its reload hook)."""
    found = app.components.get(_KEY)
    if isinstance(found, Tenancy):
        return found
    tenancy = Tenancy(app.settings.tenants)
    app.components[_KEY] = tenancy

    def reload(new: Settings) -> None:
        tenancy.apply_settings(new.tenants)

    app.reload_hooks.append(reload)
    return tenancy
