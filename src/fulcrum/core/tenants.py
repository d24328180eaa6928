"""Tenants, priorities and deadlines (issue 23): who sent a request and how urgent it is.

A request's class is a :class:`RequestClass`: its *tenant* (the fairness id: a
configured tenant's name, an unknown tenant's own string while the table has room, or
:data:`DEFAULT_TENANT`), its *priority* (a small int, higher first; default 0) and its
TTFT deadline (ns; None: none). The :class:`TenantTable` turns what a caller sent into
one, validating the priority range and the tenant string's length (a refused field
raises :class:`fulcrum.errors.InvalidArgument` naming it, before any state changes),
and bounds the tenants it tracks: past ``max_tenants`` distinct tenants, a new one is
folded into the default tenant and counted (:attr:`TenantTable.folded`), never a new
fairness id nor a new metric label.

A configured tenant's parameters are a :class:`TenantSpec` (weight, optional compute
cap, sheddable, default deadline, decode/vision caps); an unknown tenant takes the
default class's spec. The whole policy is a :class:`TenantPolicy`, built from the
``tenants:`` settings (:mod:`fulcrum.config.tenants`). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from fulcrum.errors import InvalidArgument

#: Fairness id (and metric label) of the default class: requests with no tenant, and
#: every tenant past ``max_tenants``.
DEFAULT_TENANT: Final = "default"
#: Metric label of an unknown (unconfigured) tenant: one label for all of them, so the
#: label set is the configured names plus these two.
OTHER_LABEL: Final = "other"
DEFAULT_MAX_TENANTS: Final = 10_000
DEFAULT_MAX_TENANT_LENGTH: Final = 128
DEFAULT_MIN_PRIORITY: Final = -8
DEFAULT_MAX_PRIORITY: Final = 8
DEFAULT_STARVATION_BOUND_NS: Final = 30_000_000_000
DEFAULT_CAP_WINDOW_NS: Final = 10_000_000_000
#: Longest TTFT deadline a request may ask for, ms (one day).
MAX_TTFT_SLO_MS: Final = 86_400_000


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant class's parameters.

    Attributes:
        weight: share of contended prefill compute relative to other tenants (> 0).
        compute_cap: most of the fleet's prefill compute the tenant may take, as a
            fraction in (0, 1] over the cap window (None: no cap).
        sheddable: requests whose predicted TTFT misses their deadline are refused.
        ttft_slo_ns: deadline of a request that gives none, ns (None: none).
        decode_max_concurrency: decode requests the tenant may hold at once (None: no cap).
        decode_max_kv_tokens: KV the tenant's decode requests may hold, tokens.
        vision_max_concurrency: image requests the tenant may hold on VEs at once.
    """

    weight: float = 1.0
    compute_cap: float | None = None
    sheddable: bool = False
    ttft_slo_ns: int | None = None
    decode_max_concurrency: int | None = None
    decode_max_kv_tokens: int | None = None
    vision_max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0 or self.weight != self.weight:
            raise ValueError(f"weight: must be > 0, got {self.weight}")
        if self.compute_cap is not None and not 0 < self.compute_cap <= 1:
            raise ValueError(f"compute_cap: must be in (0, 1], got {self.compute_cap}")
        for name in ("ttft_slo_ns", "decode_max_concurrency", "decode_max_kv_tokens",
                     "vision_max_concurrency"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name}: must be > 0, got {v}")


DEFAULT_SPEC: Final = TenantSpec()


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """The tenants policy (the ``tenants:`` settings in core form).

    Attributes:
        classes: configured tenants, tenant string -> spec.
        default: spec of the default class (unknown tenants, folded tenants, none given).
        max_tenants: distinct tenants tracked (configured ones included); later ones fold.
        max_tenant_length: longest tenant string, characters.
        min_priority, max_priority: the accepted priority range (inclusive).
        sheddable_priorities: priority bands whose requests are sheddable (any tenant).
        starvation_bound_ns: longest a lower band's head waits behind higher bands, ns.
        cap_window_ns: window over which a compute cap is measured, ns.
    """

    classes: Mapping[str, TenantSpec] = field(default_factory=dict)
    default: TenantSpec = DEFAULT_SPEC
    max_tenants: int = DEFAULT_MAX_TENANTS
    max_tenant_length: int = DEFAULT_MAX_TENANT_LENGTH
    min_priority: int = DEFAULT_MIN_PRIORITY
    max_priority: int = DEFAULT_MAX_PRIORITY
    sheddable_priorities: frozenset[int] = frozenset()
    starvation_bound_ns: int = DEFAULT_STARVATION_BOUND_NS
    cap_window_ns: int = DEFAULT_CAP_WINDOW_NS

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", dict(self.classes))  # a copy (picklable)
        if self.max_tenants < 1:
            raise ValueError("max_tenants: must be >= 1")
        if len(self.classes) > self.max_tenants:
            raise ValueError(f"classes: {len(self.classes)} configured tenants exceed "
                             f"max_tenants ({self.max_tenants})")
        if DEFAULT_TENANT in self.classes or OTHER_LABEL in self.classes:
            raise ValueError(f"classes: {DEFAULT_TENANT!r} and {OTHER_LABEL!r} are reserved "
                             "(configure the default class under 'default')")
        if self.max_tenant_length < 1:
            raise ValueError("max_tenant_length: must be >= 1")
        if any(len(t) > self.max_tenant_length or not t for t in self.classes):
            raise ValueError("classes: a tenant name is empty or longer than "
                             "max_tenant_length")
        if self.min_priority > 0 or self.max_priority < 0:
            raise ValueError("min_priority, max_priority: the range must include 0")
        if any(not self.min_priority <= p <= self.max_priority
               for p in self.sheddable_priorities):
            raise ValueError("sheddable_priorities: must lie in [min_priority, max_priority]")
        if self.starvation_bound_ns <= 0 or self.cap_window_ns <= 0:
            raise ValueError("starvation_bound_ns, cap_window_ns: must be > 0")

    @property
    def single(self) -> bool:
        """True when no tenant is configured and the default class has no cap (then the
        fair order of one tenant at priority 0 is FIFO)."""
        return not self.classes and self.default.compute_cap is None


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A request's class: ``tenant`` (fairness id), ``priority`` (higher first) and TTFT
    deadline ``ttft_slo_ns`` (ns from submission; None: none)."""

    tenant: str = DEFAULT_TENANT
    priority: int = 0
    ttft_slo_ns: int | None = None


#: The class of a request that says nothing (today's only class).
DEFAULT_CLASS: Final = RequestClass()


class TenantTable:
    """Resolves what a caller sent to a :class:`RequestClass`, bounded by the policy.

    Tracks the distinct unknown tenants it has seen, at most ``max_tenants`` minus the
    configured ones; a further one is folded into :data:`DEFAULT_TENANT` and counted in
    :attr:`folded`. Memory: one string per tracked tenant.
    """

    def __init__(self, policy: TenantPolicy | None = None) -> None:
        self.policy = policy or TenantPolicy()
        self._seen: set[str] = set()
        #: Requests whose tenant was folded into the default class (table full).
        self.folded = 0

    def apply(self, policy: TenantPolicy) -> None:
        """Adopt a reloaded policy; tenants already tracked stay tracked (a smaller
        ``max_tenants`` only stops new ones)."""
        self.policy = policy
        self._seen -= set(policy.classes)

    @property
    def tracked(self) -> int:
        """Distinct unknown tenants tracked (configured ones not counted)."""
        return len(self._seen)

    def tenant_of(self, tenant: str) -> str:
        """The fairness id of ``tenant`` (validated: ``InvalidArgument`` on ``tenant``
        when longer than ``max_tenant_length`` characters); tracks a new unknown tenant
        while there is room, else folds it (counted)."""
        p = self.policy
        if len(tenant) > p.max_tenant_length:
            raise InvalidArgument(
                "tenant", f"must be at most {p.max_tenant_length} characters, "
                f"got {len(tenant)}")
        if not tenant.isprintable():
            raise InvalidArgument("tenant", "must be printable characters only")
        if not tenant or tenant == DEFAULT_TENANT or tenant in p.classes:
            return tenant or DEFAULT_TENANT
        if tenant in self._seen:
            return tenant
        if len(self._seen) + len(p.classes) + 1 > p.max_tenants:
            self.folded += 1
            return DEFAULT_TENANT
        self._seen.add(tenant)
        return tenant

    def check_priority(self, priority: int) -> int:
        """``priority`` when inside the configured range, else ``InvalidArgument``."""
        p = self.policy
        if not p.min_priority <= priority <= p.max_priority:
            raise InvalidArgument(
                "priority", f"must be in [{p.min_priority}, {p.max_priority}], got {priority}")
        return priority

    def resolve(self, tenant: str = "", priority: int = 0,
                ttft_slo_ms: int | None = None) -> RequestClass:
        """The class of a request (``ttft_slo_ms``: its deadline, ms; None or 0: the
        class's default). Validates every field before tracking anything, so a refused
        call changes nothing."""
        self.check_priority(priority)
        if ttft_slo_ms is not None and not 0 <= ttft_slo_ms <= MAX_TTFT_SLO_MS:
            raise InvalidArgument(
                "ttft_slo_ms", f"must be in [0, {MAX_TTFT_SLO_MS}], got {ttft_slo_ms}")
        fid = self.tenant_of(tenant)
        slo = ttft_slo_ms * 1_000_000 if ttft_slo_ms else self.spec(fid).ttft_slo_ns
        return RequestClass(fid, priority, slo)

    def spec(self, tenant: str) -> TenantSpec:
        """The spec of fairness id ``tenant`` (the default class's when unconfigured)."""
        return self.policy.classes.get(tenant, self.policy.default)

    def weight(self, tenant: str) -> float:
        """The fair-share weight of fairness id ``tenant``."""
        return self.spec(tenant).weight

    def sheddable(self, rc: RequestClass) -> bool:
        """True when requests of ``rc`` may be refused on a predicted deadline miss."""
        return self.spec(rc.tenant).sheddable or rc.priority in self.policy.sheddable_priorities

    def label(self, tenant: str) -> str:
        """The bounded metric label of fairness id ``tenant``: a configured name,
        :data:`DEFAULT_TENANT`, or :data:`OTHER_LABEL` for every unknown tenant."""
        if tenant == DEFAULT_TENANT or tenant in self.policy.classes:
            return tenant
        return OTHER_LABEL

    def labels(self) -> tuple[str, ...]:
        """Every label :meth:`label` can give (configured names sorted, then the two)."""
        return (*sorted(self.policy.classes), DEFAULT_TENANT, OTHER_LABEL)
