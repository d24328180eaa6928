"""The tenant step of the decode and vision filter lists (issue 23): per-tenant caps and
lower-bands-first shedding, as one :class:`fulcrum.state.placement.SlotFilter`.

The decision is :func:`fulcrum.core.tenant_caps.refusal` (pure); this shell keeps the
per-tenant counts (:class:`fulcrum.core.tenant_caps.TenantHeld`) from the table's
``held``/``freed`` calls, answers a refusal with RESOURCE_EXHAUSTED and ``retry-after-ms``
(before anything changes), counts it in ``fulcrum_tenant_shed`` and keeps the per-tenant
gauges (set by :meth:`TenantFilter.flush`, every sweep period). It never narrows the
GPUs (``allowed`` returns None: the fast path). Memory: one entry per held request
(bounded by the table's ``max_held``) and one per tenant holding something. Event loop
only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from prometheus_client import Gauge

from fulcrum.core.tenant_caps import Fill, TenantHeld, refusal
from fulcrum.core.tenants import RequestClass, TenantSpec, TenantTable
from fulcrum.errors import ResourceExhausted
from fulcrum.metrics import tenants as tm


class ClassedRequest(Protocol):
    """A table's request tuple carrying its class (``DecodeRequest``, ``VisionRequest``)."""

    @property
    def cls(self) -> RequestClass: ...


R = TypeVar("R", bound=ClassedRequest)


class TenantFilter(Generic[R]):
    """Per-tenant caps and band shedding of one balancer (``balancer``: "decode" or
    "vision", the metric label).

    ``table``: the daemon's tenant table (its policy is read per call: reloads apply);
    ``caps``: a tenant's (max requests, max units) from its spec; ``amount``: a request's
    units (KV tokens, patches); ``fill``: the fleet's load over live GPUs; ``reserve``:
    the band reserve now (0: no band shedding); ``retry_after_ms``: the refusal's hint;
    ``gauges``: the held-requests gauge and optionally the held-units one, per label."""

    def __init__(
        self,
        balancer: str,
        table: TenantTable,
        caps: Callable[[TenantSpec], tuple[int | None, int | None]],
        amount: Callable[[R], int],
        fill: Callable[[], Fill],
        reserve: Callable[[], float],
        retry_after_ms: Callable[[], int],
        gauges: tuple[Gauge, Gauge | None],
    ) -> None:
        self.balancer = balancer
        self.table = table
        self.counts = TenantHeld()
        self._caps = caps
        self._amount = amount
        self._fill = fill
        self._reserve = reserve
        self._retry = retry_after_ms
        self._gauges = gauges
        #: request id -> (tenant, metric label at placement, units).
        self._by_id: dict[str, tuple[str, str, int]] = {}
        #: The same counts by metric label (several unconfigured tenants share 'other').
        self._labels = TenantHeld()
        self._children: dict[str, tuple[Gauge, Gauge | None]] = {}
        self._dirty: set[str] = set()  # labels whose gauges :meth:`flush` sets

    def allowed(self, request: R, slots: int, now_ns: int) -> None:
        """None (no narrowing), or ResourceExhausted when the request's class may not
        hold one more placement (its tenant's cap, or its band past the reserve)."""
        rc = request.cls
        table = self.table
        spec = table.spec(rc.tenant)
        out = refusal(table, rc, self.counts, self._caps(spec), self._amount(request),
                      self._fill, self._reserve())
        if out is None:
            return None
        tm.SHED.labels(self.balancer, table.label(rc.tenant), out.reason).inc()
        raise ResourceExhausted(f"{self.balancer}: {out.message}",
                                retry_after_ms=max(1, self._retry()))

    def held(self, request_id: str, request: R, slots: Sequence[int]) -> None:
        """``request_id`` now holds its placement: count it for its tenant."""
        tenant, amount = request.cls.tenant, self._amount(request)
        label = self.table.label(tenant)
        self._by_id[request_id] = (tenant, label, amount)
        self.counts.add(tenant, amount)
        self._labels.add(label, amount)
        self._dirty.add(label)

    def freed(self, request_id: str) -> None:
        """``request_id`` holds nothing any more (released, expired or lost)."""
        entry = self._by_id.pop(request_id, None)
        if entry is None:
            return
        tenant, label, amount = entry
        self.counts.remove(tenant, amount)
        self._labels.remove(label, amount)
        self._dirty.add(label)

    def flush(self) -> None:
        """Set the per-tenant gauges of the labels that changed since the last flush (the
        shell calls it periodically: a gauge set costs a lock, not paid per placement)."""
        for label in self._dirty:
            children = self._children.get(label)
            if children is None:  # labels() is slow: resolved once per (bounded) label
                held, units = self._gauges
                children = (held.labels(label),
                            None if units is None else units.labels(label))
                self._children[label] = children
            n, a = self._labels.held(label)
            children[0].set(n)
            if children[1] is not None:
                children[1].set(a)
        self._dirty.clear()
