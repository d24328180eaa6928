"""The prefill shell's records: what a submit and a pull get back, and the daemon's side of
a request in flight, of an engine and of a parked pull. Plain data; no behaviour beyond
field access."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.prefill.balancer import BalancerConfig, Offer, Queued, rules_by_name
from fulcrum.core.prefill.chunks import DEFAULT_FLOOR_FRACTION
from fulcrum.core.tenants import TenantPolicy
from fulcrum.units import NS_PER_MS

#: Outcomes of a submitted request (label values of ``fulcrum_prefill_submits``).
OUTCOMES = (
    "delivered",
    "cancelled",
    "deadline_exceeded",
    "unavailable",
    "queue_full",
    "no_engine",
    "duplicate",
)

#: Lease outcomes (label values of ``fulcrum_prefill_leases``): acknowledged, expired
#: (re-queued), engine_left (re-queued), cancelled (submitter gone while leased).
LEASE_OUTCOMES = ("acknowledged", "expired", "engine_left", "cancelled", "rejected_ack")


def balancer_config(settings: PrefillSettings,
                    tenants: TenantPolicy | None = None) -> BalancerConfig:
    """The core balancer's knobs from the ``prefill:`` section, with the ``tenants:``
    policy (weights, caps, starvation bound of the queue order; issue 23)."""
    return BalancerConfig(
        bounds=tuple(settings.tier_bounds),
        batch_cap_ns=tuple(settings.tier_batch_cap_ns),
        backlog_rounds=settings.backlog_rounds,
        hysteresis=settings.hysteresis,
        max_batch_requests=settings.max_batch_requests,
        rules=rules_by_name(settings.rules),
        step_quota_ns=settings.step_quota_ns,
        step_floor_ns=int(settings.step_quota_ns * DEFAULT_FLOOR_FRACTION),
        min_dwell_ns=settings.min_tier_dwell_ms * NS_PER_MS,
        tenants=tenants or TenantPolicy(),
    )


def wait_ns(requested_ms: int, default_ms: int, max_ms: int) -> int:
    """The wait (ns) of a call: ``requested_ms`` (0 = default), capped at ``max_ms``."""
    ms = default_ms if requested_ms == 0 else requested_ms
    return int(min(ms, max_ms)) * 1_000_000


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a submitted request went: engine, DP rank, tier, predicted cost (ns) and the
    time it waited in the queue (ns)."""

    engine_id: str
    dp_rank: int
    tier: int
    predicted_cost_ns: int
    waited_ns: int


@dataclass(frozen=True, slots=True)
class PulledItem:
    """One request of a pulled batch (tokens; cost in ns; its priority band; fair-share
    precedence on its rank, :data:`fulcrum.core.prefill.bands.PRECEDENCE`)."""

    request_id: str
    total_tokens: int
    cached_tokens: int
    dp_rank: int
    predicted_cost_ns: int
    priority: int = 0
    boosted: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    """A pulled batch, FIFO order; ``quota_ns`` is the sum of predicted costs;
    ``rejected`` the acknowledgements of the pull that were refused; ``lease_ms`` the
    batch's lease (0: not leased)."""

    tier: int
    items: tuple[PulledItem, ...]
    quota_ns: int
    rejected: tuple[str, ...] = ()
    lease_ms: int = 0


@dataclass(frozen=True, slots=True)
class AckReply:
    """Result of an acknowledgement: how many were accepted, and the ids refused (the
    engine must not run them)."""

    accepted: int
    rejected: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Assignment:
    """What a prefill engine needs for its quota: tier (-1: none), tier name, the tier's
    horizon (ns of queued work per DP rank) and its step budget (ns). An engine offers
    ``remaining_quota_ns = sum_r max(0, horizon_ns - rank_load_r)``."""

    tier: int
    tier_name: str
    horizon_ns: int
    step_quota_ns: int


@dataclass(slots=True, eq=False)
class Pending:
    """The daemon's side of an in-flight request (queued or leased): the future its
    callers wait on (one per request id: a duplicate submit joins it), its wait timer,
    and whether that wait ran out while the request was leased (``overdue``: it fails
    instead of being re-queued when its lease ends unacknowledged)."""

    item: Queued
    future: asyncio.Future[Delivery]
    timer: asyncio.TimerHandle | None = None
    callers: int = 1
    overdue: bool = False
    pulled_ns: int = 0
    submitter: str = ""

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def tier(self) -> int:
        return self.item.tier


@dataclass(slots=True, eq=False)
class Engine:
    """A registered prefill engine as the shell knows it (DP ranks; its own step budget,
    ns, 0: the section's); ``live`` turns False when it leaves or is replaced by a new
    incarnation, which ends its parked pulls."""

    member_id: str
    incarnation: int
    dp_ranks: int
    step_quota_ns: int = 0
    waiters: list[Waiter] = field(default_factory=list)
    live: bool = True


@dataclass(slots=True, eq=False)
class Waiter:
    """A parked pull: its engine's offer (remaining quota, ns; rank loads, ns; per band
    held, the work ahead per rank, ns) and the wake it may hold (``woken_tier``: the tier
    whose wake count it holds while woken)."""

    engine: Engine
    remaining_ns: int
    loads: list[int]
    max_requests: int
    band_loads: dict[float, list[int]] | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    woken: bool = False
    woken_tier: int = -1
    #: What a dispatch offers for it (built once: a parked pull's offer does not change).
    offer: Offer = field(init=False)
    #: Where the dispatcher keeps it (engine id, parking number): a dispatch's order.
    place: tuple[str, int] = ("", -1)

    def __post_init__(self) -> None:
        self.offer = Offer(self.engine.member_id, self.remaining_ns, self.loads,
                           self.band_loads)

    @property
    def idle(self) -> bool:
        return not any(self.loads)

    @property
    def offers_nothing(self) -> bool:
        """No quota left and no band loads (a higher band may still have room then)."""
        return self.remaining_ns <= 0 and not self.band_loads
