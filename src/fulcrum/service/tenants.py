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

from collections.abc import Callable
from typing import Any, Protocol

import structlog
from prometheus_client import Gauge

from fulcrum.config import Settings
from fulcrum.config.tenants import TenantsSettings
from fulcrum.core.tenant_caps import Fill
from fulcrum.core.tenants import RequestClass, TenantPolicy, TenantSpec, TenantTable
from fulcrum.errors import InvalidArgument
from fulcrum.metrics import tenants as tm
from fulcrum.service.app import App
from fulcrum.state.tenant_filter import TenantFilter

log = structlog.get_logger(__name__)

_KEY = "tenants"
#: A tenant's caps from its spec: (max requests, max units), None = no cap.
Caps = Callable[[TenantSpec], tuple[int | None, int | None]]


#: A request message carrying the class fields (``tenant``, ``priority``, optional
#: ``ttft_slo_ms``): SubmitRequest, PlaceDecodeRequest, PlaceImagesRequest.
ClassFields = Any


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

    @property
    def default(self) -> RequestClass:
        """The class of a request that names none."""
        return self._default

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


class FilteredTable(Protocol):
    """What :func:`install_filter` needs of a placement table (decode, vision)."""

    filters: list[Any]

    @property
    def settings(self) -> Any: ...

    def fill(self) -> Fill: ...


def needs_filter(policy: TenantPolicy, caps: Caps, reserve: float) -> bool:
    """Whether the tenant step has anything to enforce: a cap, or a sheddable class with
    a band reserve. (Without, the table keeps its unfiltered fast path.)"""
    specs = (policy.default, *policy.classes.values())
    if any(c is not None for spec in specs for c in caps(spec)):
        return True
    sheddable = bool(policy.sheddable_priorities) or any(s.sheddable for s in specs)
    return reserve > 0 and sheddable


def install_filter(
    app: App, balancer: str, state: FilteredTable, caps: Caps,
    amount: Callable[[Any], int], gauges: tuple[Gauge, Gauge | None],
) -> None:
    """Add the tenant step (:class:`TenantFilter`) to ``state``'s filter list once the
    ``tenants:`` settings give it something to enforce, now or at a later reload (a step
    added by a reload counts the placements made from then on)."""
    tenancy = tenancy_of(app)
    added: list[TenantFilter[Any]] = []

    def ensure(settings: Settings) -> None:
        if added or not needs_filter(tenancy.table.policy, caps,
                                     getattr(settings, balancer).band_reserve):
            return
        f: TenantFilter[Any] = TenantFilter(
            balancer, tenancy.table, caps, amount, state.fill,
            lambda: float(state.settings.band_reserve),
            lambda: int(state.settings.sweep_interval_ms), gauges)
        state.filters.append(f)
        added.append(f)
        log.info("tenant_filter_added", balancer=balancer)

    def flush(now_ns: int) -> None:
        for f in added:
            f.flush()

    ensure(app.settings)
    app.reload_hooks.append(ensure)  # after tenancy's own hook: the new policy is read
    app.every(lambda: state.settings.sweep_interval_ms / 1000, flush, f"{balancer}-tenants")


def decode_caps(spec: TenantSpec) -> tuple[int | None, int | None]:
    """A tenant's decode caps: (requests, KV tokens)."""
    return spec.decode_max_concurrency, spec.decode_max_kv_tokens


def vision_caps(spec: TenantSpec) -> tuple[int | None, int | None]:
    """A tenant's vision cap: (image requests, no unit cap)."""
    return spec.vision_max_concurrency, None


def class_of(
    tenancy: Tenancy, request: ClassFields, refused: Callable[[str], None]
) -> RequestClass:
    """``tenancy.of(request)``, counting a refused field through
    ``refused("invalid_argument")`` (the table's outcome counter)."""
    try:
        return tenancy.of(request)
    except InvalidArgument:
        refused("invalid_argument")
        raise
