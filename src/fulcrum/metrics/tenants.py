"""Prometheus collectors of tenants, priorities and deadlines (issue 23), on
:data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``tenant`` is a configured tenant's name (``tenants.classes``),
``"default"`` (no tenant, or folded past ``tenants.max_tenants``) or ``"other"`` (every
unconfigured tenant: one label for all of them), as given by
:meth:`fulcrum.core.tenants.TenantTable.label`; never a free tenant string. ``priority``
is a band inside ``tenants.min_priority .. max_priority`` (at most 2001 values, 17 by
default), ``balancer`` one of :data:`BALANCERS`, ``reason`` one of :data:`SHED_REASONS`,
``field`` one of :data:`FIELDS`, ``header`` one of :data:`HEADERS`.

Plain values set on the event loop as things happen (no callback reads state at scrape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import Counter, Gauge, Histogram

from fulcrum.metrics import REGISTRY

if TYPE_CHECKING:
    from fulcrum.core.prefill.items import Queued
    from fulcrum.core.tenants import RequestClass

#: Balancers that see a request's class (label values of ``balancer``).
BALANCERS: Final = ("prefill", "decode", "vision")
#: Why a request of a class was refused (label values of ``reason``): ``deadline``
#: (sheddable class, predicted TTFT misses its deadline), ``cap`` (the tenant's
#: concurrency, KV or compute cap), ``band`` (fleet nearly full: a lower band refused
#: first).
SHED_REASONS: Final = ("deadline", "cap", "band")
#: Request fields the service boundary validates (label values of ``field``).
FIELDS: Final = ("tenant", "priority", "ttft_slo_ms")
#: Roles of the headers the gateway reads (label values of ``header``): the fairness
#: id (x-gateway-inference-fairness-id), the objective (x-gateway-inference-objective)
#: and the TTFT deadline (x-slo-ttft-ms).
HEADERS: Final = ("fairness_id", "objective", "ttft_slo_ms")
#: Why the gateway ignored a header (label values of ``reason``).
HEADER_REASONS: Final = ("malformed", "out_of_range", "unknown_objective", "too_long")

#: Seconds, for queue waits: 1 ms .. 10 min.
_SECONDS = (
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)

PREFILL_COMPUTE = Counter(
    "fulcrum_tenant_prefill_compute_seconds",
    "Predicted prefill compute delivered to engines (acknowledged requests), by tenant "
    "label, seconds of GPU time (cost(q, c) of the uncached part).",
    ["tenant"],
    registry=REGISTRY,
)
PRIORITY_COMPUTE = Counter(
    "fulcrum_priority_prefill_compute_seconds",
    "Predicted prefill compute delivered to engines, by priority band, seconds.",
    ["priority"],
    registry=REGISTRY,
)
PREFILL_QUEUED = Gauge(
    "fulcrum_tenant_prefill_queue_depth",
    "Prefill requests waiting for an engine (all tiers), by tenant label, requests.",
    ["tenant"],
    registry=REGISTRY,
)
PREFILL_QUEUED_SECONDS = Gauge(
    "fulcrum_tenant_prefill_queued_compute_seconds",
    "Predicted compute of the queued prefill requests, by tenant label, seconds.",
    ["tenant"],
    registry=REGISTRY,
)
PREFILL_WAIT = Histogram(
    "fulcrum_tenant_prefill_wait_seconds",
    "Time from Submit to the engine's pull of a delivered prefill request, by tenant "
    "label, seconds.",
    ["tenant"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
SHED = Counter(
    "fulcrum_tenant_shed",
    "Requests refused for their class (RESOURCE_EXHAUSTED with retry-after-ms), by "
    "balancer, tenant label and reason: deadline (sheddable class, predicted TTFT misses "
    "its deadline), cap (tenant cap), band (fleet nearly full, lower band first).",
    ["balancer", "tenant", "reason"],
    registry=REGISTRY,
)
DEADLINE_MISSES = Counter(
    "fulcrum_tenant_deadline_misses",
    "Requests with a TTFT deadline that missed it: prefill requests delivered with wait "
    "plus predicted cost over the deadline, or expired in the queue; by tenant label.",
    ["balancer", "tenant"],
    registry=REGISTRY,
)
FOLDED = Counter(
    "fulcrum_tenant_folded",
    "Requests whose tenant was folded into the default class because "
    "tenants.max_tenants distinct tenants are already tracked.",
    registry=REGISTRY,
)
TRACKED = Gauge(
    "fulcrum_tenants_tracked",
    "Distinct unconfigured tenants tracked as their own fairness id (bounded by "
    "tenants.max_tenants minus the configured ones), tenants.",
    registry=REGISTRY,
)
INVALID = Counter(
    "fulcrum_tenant_invalid_fields",
    "Requests refused INVALID_ARGUMENT for a class field (tenant too long or not "
    "printable, priority out of range, ttft_slo_ms out of range), by field.",
    ["field"],
    registry=REGISTRY,
)
DECODE_HELD = Gauge(
    "fulcrum_tenant_decode_placements",
    "Decode placements held, by tenant label, requests.",
    ["tenant"],
    registry=REGISTRY,
)
DECODE_KV = Gauge(
    "fulcrum_tenant_decode_kv_tokens",
    "KV held by the decode placements of each tenant label, tokens.",
    ["tenant"],
    registry=REGISTRY,
)
VISION_HELD = Gauge(
    "fulcrum_tenant_vision_requests",
    "Image requests placed on VEs and not released, by tenant label, requests.",
    ["tenant"],
    registry=REGISTRY,
)
HEADER_IGNORED = Counter(
    "fulcrum_gateway_tenancy_headers_ignored",
    "Tenancy headers the gateway ignored (the request goes on with the default for that "
    "field), by header role (fairness_id, objective, ttft_slo_ms) and reason: malformed "
    "(not a number, not printable, repeated with differing values), out_of_range, "
    "unknown_objective (no gateway.tenancy.objectives entry: priority 0), too_long.",
    ["header", "reason"],
    registry=REGISTRY,
)


class PrefillMeter:
    """Per-tenant prefill figures, set by the prefill shell as requests queue, leave the
    queues and are delivered. ``label``: a fairness id's bounded label
    (:meth:`fulcrum.core.tenants.TenantTable.label`), read when a request queues and kept
    with it (so a reload never unbalances a gauge). Memory: one entry per queued request
    (bounded by the tier queues' bound). Event loop only."""

    def __init__(self, label: Callable[[str], str]) -> None:
        self._label = label
        #: queued request id -> (label, predicted ns).
        self._ids: dict[str, tuple[str, int]] = {}
        #: label -> (requests queued, predicted ns queued).
        self._queued: dict[str, tuple[int, int]] = {}
        #: label -> its children (queued, queued s, compute, wait), resolved once: labels
        #: are bounded, and a labels() lookup per request was a quarter of the state's
        #: cost per request (bench_prefill, daemon tables).
        self._kids: dict[str, tuple[Any, Any, Any, Any]] = {}
        #: priority -> its compute counter child.
        self._prio: dict[int, Any] = {}

    def _children(self, label: str) -> tuple[Any, Any, Any, Any]:
        kids = self._kids.get(label)
        if kids is None:
            kids = self._kids[label] = (
                PREFILL_QUEUED.labels(label), PREFILL_QUEUED_SECONDS.labels(label),
                PREFILL_COMPUTE.labels(label), PREFILL_WAIT.labels(label))
        return kids

    def queued(self, item: Queued) -> None:
        """``item`` joined a tier queue (submitted, or put back after a lease)."""
        if item.request_id in self._ids:
            return
        label = self._label(item.cls.tenant)
        self._ids[item.request_id] = (label, item.cost_ns)
        n, ns = self._queued.get(label, (0, 0))
        self._set(label, n + 1, ns + item.cost_ns)

    def left(self, request_id: str) -> None:
        """The request left the queues (taken by a pull, cancelled, expired, drained);
        nothing when it was not queued."""
        entry = self._ids.pop(request_id, None)
        if entry is None:
            return
        label, cost = entry
        n, ns = self._queued.get(label, (0, 0))
        self._set(label, max(0, n - 1), max(0, ns - cost))

    def took(self, items: Iterable[Queued]) -> None:
        """A pull took these requests out of the queues (delivered, leased or dead)."""
        for item in items:
            self.left(item.request_id)

    def _set(self, label: str, n: int, ns: int) -> None:
        if n:
            self._queued[label] = (n, ns)
        else:
            self._queued.pop(label, None)
            ns = 0
        queued, seconds, _, _ = self._children(label)
        queued.set(n)
        seconds.set(ns / 1e9)

    def delivered(self, item: Queued, waited_ns: int) -> None:
        """``item`` was delivered after ``waited_ns`` (ns) queued: its predicted compute
        is served to its tenant; a predicted TTFT (wait + cost) past its deadline is a
        miss."""
        label = self._label(item.cls.tenant)
        _, _, compute, wait = self._children(label)
        compute.inc(item.cost_ns / 1e9)
        prio = self._prio.get(item.cls.priority)
        if prio is None:
            prio = self._prio[item.cls.priority] = PRIORITY_COMPUTE.labels(
                str(item.cls.priority))
        prio.inc(item.cost_ns / 1e9)
        wait.observe(waited_ns / 1e9)
        slo = item.cls.ttft_slo_ns
        if slo is not None and waited_ns + item.cost_ns > slo:
            DEADLINE_MISSES.labels("prefill", label).inc()

    def expired(self, item: Queued) -> None:
        """``item`` failed DEADLINE_EXCEEDED: a miss when it had a TTFT deadline."""
        if item.cls.ttft_slo_ns is not None:
            DEADLINE_MISSES.labels("prefill", self._label(item.cls.tenant)).inc()

    def shed(self, cls: RequestClass) -> None:
        """A sheddable request was refused on a predicted deadline miss."""
        SHED.labels("prefill", self._label(cls.tenant), "deadline").inc()
