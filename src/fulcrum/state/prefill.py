"""In-memory state of the prefill balancer: the daemon's shell around the core balancer.

The balancing itself -- tier queues, round demand and engine redistribution, who may
pull, batch taking -- is :class:`fulcrum.core.prefill.balancer.PrefillBalancer`, the
very object the simulator drives. This module adds only what a daemon needs around it:
futures of waiting submits, their timers, long-polling pulls, metrics and logs, and the
cost-model refit.

Life of a request (every transition is synchronous on the event loop, so each request is
in exactly one place at a time):

1. ``submit`` validates, predicts its cost with the model in force (ns, including the
   fixed step cost ``k``), queues it in the balancer and waits on a future.
2. It leaves the queue exactly once, by one of: being taken in a batch by an engine's
   pull (the future gets the :class:`Delivery`: outcome ``delivered``); its wait expiring
   (DEADLINE_EXCEEDED); its caller cancelling (``cancelled``); the daemon draining
   (UNAVAILABLE). A request whose caller has gone is never put in a batch.
3. Pulls are long polls: a pull that finds nothing it may take waits. When work arrives
   in a tier, the balancer chooses which waiting pull takes it (one woken at a time per
   tier); it takes its batch itself, then passes the wake on if work is left.

Engines follow the fleet (join/leave). Every round the balancer redistributes engines
across tiers; joins, leaves and a tier receiving work with no engine ("orphan") do so
at once. Engines report step times; a bounded window feeds a periodic refit of the
cost model, adopted only when better by the configured margin.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.cost import CostModel, evaluate, fit, should_adopt
from fulcrum.core.prefill.balancer import (
    BalancerConfig,
    Offer,
    PrefillBalancer,
    Queued,
    Redistribution,
    Taken,
    rules_by_name,
)
from fulcrum.core.prefill.leases import AckResult, Lease, LeaseTable, requeue_order
from fulcrum.core.prefill.tiers import tier_label
from fulcrum.core.types import Member, MemberKind, MemberLoad, PrefillEngineShape
from fulcrum.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.metrics import prefill as m
from fulcrum.state.fleet import Fleet
from fulcrum.state.prefix import PrefixWiring
from fulcrum.state.retention import RetentionTable
from fulcrum.units import MAX_U64, NS_PER_MS, NS_PER_S

log = structlog.get_logger(__name__)

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
_LEASES = {o: m.LEASES.labels(o) for o in LEASE_OUTCOMES}


def balancer_config(settings: PrefillSettings) -> BalancerConfig:
    """The core balancer's knobs from the ``prefill:`` section."""
    return BalancerConfig(
        bounds=tuple(settings.tier_bounds),
        batch_cap_ns=tuple(settings.tier_batch_cap_ns),
        backlog_rounds=settings.backlog_rounds,
        hysteresis=settings.hysteresis,
        max_batch_requests=settings.max_batch_requests,
        rules=rules_by_name(settings.rules),
        step_quota_ns=settings.step_quota_ns,
        min_dwell_ns=settings.min_tier_dwell_ms * NS_PER_MS,
    )


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
    """One request of a pulled batch (tokens; cost in ns)."""

    request_id: str
    total_tokens: int
    cached_tokens: int
    dp_rank: int
    predicted_cost_ns: int


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


@dataclass(slots=True, eq=False)
class _Pending:
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
class _Engine:
    member_id: str
    incarnation: int
    dp_ranks: int
    step_quota_ns: int = 0
    waiters: list[_Waiter] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Waiter:
    engine: _Engine
    remaining_ns: int
    loads: list[int]
    max_requests: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    woken: bool = False
    woken_tier: int = -1  # tier whose wake count it holds while woken

    @property
    def idle(self) -> bool:
        return not any(self.loads)


class _TierMetrics:
    """Label children of one tier, resolved once (``labels()`` is slow on hot paths)."""

    __slots__ = (
        "batch_quota",
        "batch_requests",
        "demand",
        "depth",
        "engines",
        "imbalance",
        "leased_quota",
        "outcomes",
        "predicted",
        "pulls_batch",
        "pulls_empty",
        "quota",
        "wait",
    )

    def __init__(self, label: str) -> None:
        self.depth = m.QUEUE_DEPTH.labels(label)
        self.quota = m.QUEUED_QUOTA.labels(label)
        self.engines = m.ENGINES.labels(label)
        self.imbalance = m.RANK_IMBALANCE.labels(label)
        self.leased_quota = m.LEASED_QUOTA.labels(label)
        self.demand = m.DEMAND.labels(label)
        self.predicted = m.PREDICTED_COST.labels(label)
        self.wait = m.WAIT.labels(label)
        self.batch_requests = m.BATCH_REQUESTS.labels(label)
        self.batch_quota = m.BATCH_QUOTA.labels(label)
        self.pulls_batch = m.PULLS.labels(label, "batch")
        self.pulls_empty = m.PULLS.labels(label, "empty")
        self.outcomes = {o: m.SUBMITS.labels(label, o) for o in OUTCOMES}


class PrefillState:
    """The prefill balancer's daemon shell. One per daemon (``app.components["prefill"]``)."""

    def __init__(
        self,
        settings: PrefillSettings,
        fleet: Fleet,
        clock: Callable[[], int],
    ) -> None:
        self.settings = settings
        self._fleet = fleet
        self._clock = clock
        self.balancer = PrefillBalancer(balancer_config(settings))
        self.bounds = self.balancer.bounds
        self.n_tiers = self.balancer.n_tiers
        self.labels = tuple(tier_label(self.bounds, t) for t in range(self.n_tiers))
        cm = settings.cost_model
        self.model = CostModel(a=cm.a, b=cm.b, k=cm.k)
        self.model_version = 1
        self._index: dict[str, _Pending] = {}  # in flight: queued or leased
        self._held_hashes = 0  # block hashes of the requests in _index
        self.leases = LeaseTable(self.n_tiers)
        #: Acknowledged requests kept for idempotent re-submits, bounded per submitter.
        self._done: RetentionTable[Delivery] = RetentionTable()
        self._engines: dict[str, _Engine] = {}
        self._waiters: list[_Waiter] = []
        self._woken = [0] * self.n_tiers  # woken waiters not yet run, per tier
        self._samples: deque[tuple[int, int, int]] = deque(maxlen=settings.refit.window_samples)
        self.draining = False
        #: Test/diagnostic hooks: called with (request_id, outcome, engine_id or "").
        self.outcome_hooks: list[Callable[[str, str, str], None]] = []
        self._m = [_TierMetrics(label) for label in self.labels]
        # [request tier][engine tier] children, resolved once (labels() is slow).
        self._helped = [[m.HELPED.labels(t, e) for e in self.labels] for t in self.labels]
        self.prefix = PrefixWiring(self.balancer, settings, self.model_cost_ns, self.labels)
        self._log = log.bind()  # resolved once: per-request debug lines cost ~nothing
        for t in range(self.n_tiers):
            self._gauge_tier(t)
            self._m[t].engines.set(0)
        self._gauge_model()

    # -- queries ---------------------------------------------------------------------------

    @property
    def last_demand_ns(self) -> list[float]:
        """Each tier's demand in the last closed round (ns)."""
        return self.balancer.last_demand_ns

    @last_demand_ns.setter
    def last_demand_ns(self, value: Sequence[float]) -> None:
        self.balancer.last_demand_ns = [float(x) for x in value]

    @property
    def moves_total(self) -> int:
        """Engines moved between tiers since start."""
        return self.balancer.moves_total

    def tier_of(self, total_tokens: int) -> int:
        """Tier index of a request of ``total_tokens`` context (tokens)."""
        return self.balancer.tier_of(total_tokens)

    def engines_per_tier(self) -> list[int]:
        """Engines assigned to each tier now."""
        return self.balancer.engines_per_tier()

    def engine_tier(self, engine_id: str) -> int:
        """The tier an engine serves (-1 when unknown)."""
        return self.balancer.engine_tier(engine_id)

    def queue_depths(self) -> list[int]:
        """Requests queued in each tier."""
        return [self.balancer.queue_depth(t) for t in range(self.n_tiers)]

    def queued_ns(self) -> list[int]:
        """Predicted quota queued in each tier (ns)."""
        return [self.balancer.queued_ns(t) for t in range(self.n_tiers)]

    def is_queued(self, request_id: str) -> bool:
        """True while ``request_id`` waits in a tier queue."""
        return self.balancer.get(request_id) is not None

    def is_leased(self, request_id: str) -> bool:
        """True while ``request_id`` is leased to an engine (pulled, not acknowledged)."""
        return request_id in self.leases

    def in_flight(self) -> int:
        """Requests queued or leased."""
        return len(self._index)

    def waiting_pulls(self, tier: int) -> int:
        """Pulls currently long-polling (not woken) by engines of ``tier``."""
        return sum(
            1 for w in self._waiters
            if not w.woken and self.balancer.engine_tier(w.engine.member_id) == tier
        )

    def model_cost_ns(self, q: int, c: int) -> int:
        """The live cost model (ns, with ``k``) of ``q`` tokens after ``c`` cached."""
        return min(MAX_U64, self.model.cost_ns(q, c))

    def assignment(self, engine_id: str) -> Assignment:
        """The engine's tier, horizon and step budget now (see :class:`Assignment`)."""
        tier = self.engine_tier(engine_id)
        eng = self._engines.get(engine_id)
        own = eng.step_quota_ns if eng is not None else 0
        s = self.settings
        horizon = s.horizons_ns()[tier] if tier >= 0 else 0
        return Assignment(tier, self.labels[tier] if tier >= 0 else "", horizon,
                          own or s.step_quota_ns)

    def predict_ns(self, total: int, cached: int) -> int:
        """Predicted cost (ns, with ``k``) of prefilling ``total - cached`` tokens after
        ``cached``."""
        return min(MAX_U64, self.model.cost_ns(total - cached, cached))

    # -- submit ----------------------------------------------------------------------------

    def validate_submit(self, request_id: str, total: int, cached: int) -> int:
        """Raise the domain error of an invalid or refused submit; return its tier."""
        if total <= 0:
            raise InvalidArgument("total_tokens", "must be > 0")
        if total > self.settings.max_total_tokens:
            raise InvalidArgument(
                "total_tokens", f"must be <= {self.settings.max_total_tokens} (max_total_tokens)"
            )
        if cached < 0:
            raise InvalidArgument("cached_tokens", "must be >= 0")
        if cached >= total:
            raise InvalidArgument("cached_tokens", "must be < total_tokens")
        if self.draining:
            raise Unavailable("prefill: the daemon is draining; resubmit elsewhere")
        if request_id in self._index:
            raise AlreadyExists(f"request_id: {request_id!r} is already queued")
        tier = self.tier_of(total)
        if not self._engines:
            self._m[tier].outcomes["no_engine"].inc()
            raise Unavailable(
                "prefill: no live prefill engine is registered; retry later",
                retry_after_ms=self.settings.no_engine_retry_after_ms,
            )
        if self.balancer.queue_depth(tier) >= self.settings.max_queued_per_tier:
            self._m[tier].outcomes["queue_full"].inc()
            raise ResourceExhausted(
                f"prefill: tier {self.labels[tier]} queue is at its bound of "
                f"{self.settings.max_queued_per_tier} requests",
                retry_after_ms=self.settings.round_period_ms,
            )
        return tier

    def _same(self, rec: _Pending, total: int, cached: int) -> bool:
        return rec.item.total == total and rec.item.cached == cached

    def retained(self, request_id: str) -> Delivery | None:
        """The acknowledged outcome kept for ``request_id`` (within the retention window),
        or None."""
        entry = self._done.get(request_id, self._clock())
        return None if entry is None else entry.outcome

    def _retain(self, rec: _Pending, delivery: Delivery) -> None:
        now = self._clock()
        self._done.put(rec.request_id, rec.item.total, rec.item.cached, delivery,
                       now + self.settings.retention_ms * 1_000_000, rec.submitter)
        self._done.purge(now)
        m.RETAINED.set(len(self._done))

    async def submit(
        self, request_id: str, total: int, cached: int, wait_ns: int,
        block_hashes: Sequence[int] = (),
        submitter: str = "",
    ) -> Delivery:
        """Queue a request and wait until an engine acknowledges it (or it fails).

        Idempotent: the same id with the same lengths joins the request in flight, or
        gets the retained outcome of an acknowledged one; another request reusing an id in
        flight is ALREADY_EXISTS."""
        rec0 = self._index.get(request_id)
        if rec0 is not None:
            if not self._same(rec0, total, cached):
                raise AlreadyExists(
                    f"request_id: {request_id!r} is in flight with other total_tokens or "
                    "cached_tokens"
                )
            self._m[rec0.tier].outcomes["duplicate"].inc()
            return await self._wait(rec0, joined=True)
        now = self._clock()
        entry = self._done.get(request_id, now)
        if entry is not None:
            if entry.total != total or entry.cached != cached:
                raise AlreadyExists(
                    f"request_id: {request_id!r} was acknowledged with other "
                    "total_tokens or cached_tokens within prefill.retention_ms; its "
                    "outcome is kept")
            self._m[entry.outcome.tier].outcomes["duplicate"].inc()
            return entry.outcome
        tier = self.validate_submit(request_id, total, cached)
        s = self.settings
        self._done.admit(submitter, now, s.max_retained, s.max_retained_per_submitter)
        loop = asyncio.get_running_loop()
        blocks = self.prefix.blocks(block_hashes)
        self._check_hashes(len(blocks))
        tier = self.prefix.tier(total, blocks, tier)
        item = Queued(
            request_id=request_id,
            total=total,
            cached=cached,
            tier=tier,
            cost_ns=self.prefix.cost(total, cached, blocks, self.predict_ns(total, cached)),
            enqueued_ns=now,
            blocks=blocks,
        )
        rec = _Pending(item, loop.create_future(), submitter=submitter)
        self._index[request_id] = rec
        self._held_hashes += len(blocks)
        m.BLOCK_HASHES_HELD.set(self._held_hashes)
        red = self.balancer.enqueue(item)
        rec.timer = loop.call_later(max(0.0, wait_ns / NS_PER_S), self._expire, rec)
        self._m[tier].predicted.observe(item.cost_ns / NS_PER_S)
        self._gauge_tier(tier)
        self._log.debug("prefill_queued", request_id=request_id, tier=tier, cost_ns=item.cost_ns)
        if red is not None:
            self._redistributed(red)
        else:
            self._dispatch(tier)
        return await self._wait(rec, joined=False)

    async def _wait(self, rec: _Pending, *, joined: bool) -> Delivery:
        """Wait on a request's outcome; the last caller to go cancels it."""
        if joined:
            rec.callers += 1
        try:
            return await asyncio.shield(rec.future)
        except asyncio.CancelledError:
            rec.callers -= 1
            if rec.callers <= 0 and self._index.get(rec.request_id) is rec:
                if not rec.future.done():
                    rec.future.cancel()
                self._drop(rec, "cancelled")
            raise

    def _drop(self, rec: _Pending, outcome: str, error: Exception | None = None) -> None:
        """Take a request out of its queue or lease without delivering it."""
        self.balancer.remove(rec.request_id)
        if self.leases.release(rec.request_id) is not None:
            _LEASES["cancelled"].inc()
            self._gauge_leases(rec.tier)
        self._forget(rec)
        if error is not None and not rec.future.done():
            rec.future.set_exception(error)
        self._outcome(rec, outcome)

    def _outcome(self, rec: _Pending, outcome: str) -> None:
        self._m[rec.tier].outcomes[outcome].inc()
        self._gauge_tier(rec.tier)
        for hook in self.outcome_hooks:
            hook(rec.request_id, outcome, "")

    def _check_hashes(self, n: int) -> None:
        """RESOURCE_EXHAUSTED when ``n`` more block hashes would pass the in-flight bound."""
        bound = self.settings.max_block_hashes_in_flight
        if n and self._held_hashes + n > bound:
            raise ResourceExhausted(
                f"prefill: the requests in flight carry {self._held_hashes} block hashes; "
                f"{n} more would pass prefill.max_block_hashes_in_flight ({bound})",
                retry_after_ms=self.settings.round_period_ms,
            )

    def _forget(self, rec: _Pending) -> None:
        del self._index[rec.request_id]
        self._held_hashes -= len(rec.item.blocks)
        m.BLOCK_HASHES_HELD.set(self._held_hashes)
        if rec.timer is not None:
            rec.timer.cancel()
            rec.timer = None

    def _expire(self, rec: _Pending) -> None:
        if self._index.get(rec.request_id) is not rec:
            return
        if rec.future.done():  # its caller is gone
            self._drop(rec, "cancelled")
            return
        if rec.request_id in self.leases:
            # An engine holds it: its acknowledgement decides (exactly once); should the
            # lease end unacknowledged, the request fails instead of going back.
            rec.overdue = True
            rec.timer = None
            return
        waited_ms = (self._clock() - rec.item.enqueued_ns) // 1_000_000
        self._drop(
            rec,
            "deadline_exceeded",
            DeadlineExceeded(
                f"prefill: no engine took the request in {waited_ms} ms "
                f"(tier {self.labels[rec.tier]})"
            ),
        )

    # -- pull ------------------------------------------------------------------------------

    def _engine_for_pull(self, engine_id: str, incarnation: int) -> _Engine:
        """The live prefill engine of a call; a refused call is not a heartbeat."""
        now = self._clock()
        try:
            member = self._fleet.get_live(engine_id, incarnation or None, now)
        except NotFound as err:
            raise NotFound(err.message.replace("member_id:", "engine_id:", 1)) from None
        eng = self._engines.get(engine_id)
        if member.kind is not MemberKind.PREFILL_ENGINE or eng is None:
            raise NotFound(f"engine_id: {engine_id!r} is not a registered prefill engine")
        if incarnation:  # a pull from the current incarnation also counts as a heartbeat
            self._fleet.heartbeat(engine_id, incarnation, None, now)
        return eng

    def validate_pull(
        self, engine_id: str, incarnation: int, rank_loads_ns: Sequence[int]
    ) -> _Engine:
        """The live engine of a pull, or NotFound / FailedPrecondition / InvalidArgument."""
        eng = self._engine_for_pull(engine_id, incarnation)
        if rank_loads_ns and len(rank_loads_ns) != eng.dp_ranks:
            raise InvalidArgument(
                "rank_loads_ns", f"must have {eng.dp_ranks} entries (one per DP rank) or none"
            )
        return eng

    # -- acknowledgements and leases -------------------------------------------------------

    def ack(self, engine_id: str, incarnation: int, request_ids: Sequence[str]) -> AckReply:
        """``engine_id`` accepted these leased requests: each resolves its submit with this
        engine and its DP rank. Ids not leased to it (expired and re-queued, submitter
        gone, unknown) are refused: the engine must not run them."""
        limit = self.settings.max_batch_requests
        if len(request_ids) > limit:
            raise InvalidArgument(
                "ack_request_ids", f"must have at most {limit} entries (max_batch_requests)"
            )
        eng = self._engine_for_pull(engine_id, incarnation)
        return self._ack(eng, request_ids)

    def _ack(self, eng: _Engine, request_ids: Sequence[str]) -> AckReply:
        if not request_ids:
            return AckReply(0, ())
        res = self.leases.ack(eng.member_id, request_ids, self._clock())
        tiers: set[int] = set()
        for lease in res.accepted:
            rec = self._index[lease.request_id]
            self._forget(rec)
            item = lease.item
            tiers.add(item.tier)
            delivery = Delivery(
                eng.member_id, lease.dp_rank, item.tier, item.cost_ns,
                max(0, rec.pulled_ns - item.enqueued_ns),
            )
            self._resolve(rec, delivery)
        if res.accepted:
            _LEASES["acknowledged"].inc(len(res.accepted))
        rejected = tuple(
            rid for rid in res.rejected
            if (d := self.retained(rid)) is None or d.engine_id != eng.member_id
        )  # a retried acknowledgement (lost reply) of a request this engine holds is fine
        res = AckResult(res.accepted, rejected)
        if res.rejected:
            _LEASES["rejected_ack"].inc(len(res.rejected))
            self._log.info("prefill_ack_rejected", engine_id=eng.member_id,
                           n=len(res.rejected))
        for t in tiers:
            self._gauge_leases(t)
        return AckReply(len(res.accepted), res.rejected)

    def _resolve(self, rec: _Pending, delivery: Delivery) -> None:
        """Resolve a submit (exactly once) and keep its outcome for re-submits."""
        if not rec.future.done():
            rec.future.set_result(delivery)
        self._retain(rec, delivery)
        tm = self._m[delivery.tier if 0 <= delivery.tier < self.n_tiers else rec.tier]
        tm.wait.observe(delivery.waited_ns / NS_PER_S)
        self._m[rec.tier].outcomes["delivered"].inc()
        for hook in self.outcome_hooks:
            hook(rec.request_id, "delivered", delivery.engine_id)

    def _lease_timer(self, leases: list[Lease]) -> None:
        """A batch's lease ran out: unacknowledged requests go back to the head."""
        current = [x for x in leases if self.leases.get(x.request_id) is x]
        for x in current:
            self.leases.release(x.request_id)
        self._requeue(current, "expired")

    def _requeue(self, leases: Sequence[Lease], reason: str) -> None:
        """Put unacknowledged leased requests back at the head of their tiers (or fail
        those whose wait ran out, drop those whose callers left)."""
        if not leases:
            return
        _LEASES[reason].inc(len(leases))
        back = []
        tiers: set[int] = set()
        for x in leases:
            rec = self._index.get(x.request_id)
            tiers.add(x.item.tier)
            if rec is None:
                continue
            if rec.future.done():
                self._forget(rec)
                self._outcome(rec, "cancelled")
            elif rec.overdue:
                self._forget(rec)
                rec.future.set_exception(DeadlineExceeded(
                    "prefill: no engine acknowledged the request in time "
                    f"(tier {self.labels[rec.tier]}; its lease ended: {reason})"
                ))
                self._outcome(rec, "deadline_exceeded")
            else:
                back.append(x)
        self.balancer.requeue_front(requeue_order(back))
        self._log.info("prefill_leases_requeued", reason=reason, n=len(back),
                       engine_id=leases[0].engine_id)
        for t in tiers:
            self._gauge_tier(t)
            self._gauge_leases(t)
        self._dispatch_all()

    async def pull(
        self,
        engine_id: str,
        incarnation: int,
        remaining_ns: int,
        rank_loads_ns: Sequence[int],
        wait_ns: int,
        max_requests: int,
        *,
        lease: bool = False,
        ack_ids: Sequence[str] = (),
    ) -> Batch:
        """An engine's pull: a batch now, or after a long poll of up to ``wait_ns``.

        ``ack_ids`` are acknowledged first (refusals come back in ``Batch.rejected``).
        ``lease``: the batch is leased (acknowledged delivery); otherwise handing it over
        acknowledges it."""
        eng = self.validate_pull(engine_id, incarnation, rank_loads_ns)
        if lease and not rank_loads_ns:
            raise InvalidArgument(
                "rank_loads_ns",
                f"required with acknowledged delivery: {eng.dp_ranks} entries, one per DP "
                "rank (0 for an idle rank); only ack_on_reply pulls may omit it",
            )
        if len(ack_ids) > self.settings.max_batch_requests:
            raise InvalidArgument(
                "ack_request_ids",
                f"must have at most {self.settings.max_batch_requests} entries "
                "(max_batch_requests)",
            )
        rejected = self._ack(eng, ack_ids).rejected
        batch = await self._pull(eng, engine_id, incarnation, remaining_ns, rank_loads_ns,
                                 wait_ns, max_requests, lease)
        if rejected:
            batch = Batch(batch.tier, batch.items, batch.quota_ns, rejected, batch.lease_ms)
        return batch

    async def _pull(
        self,
        eng: _Engine,
        engine_id: str,
        incarnation: int,
        remaining_ns: int,
        rank_loads_ns: Sequence[int],
        wait_ns: int,
        max_requests: int,
        lease: bool,
    ) -> Batch:
        loads = [int(x) for x in rank_loads_ns] if rank_loads_ns else [0] * eng.dp_ranks
        self._note_imbalance(engine_id, loads)
        limit = max_requests if max_requests > 0 else 0
        batch = self._take(eng, remaining_ns, loads, limit, lease)
        if batch.items or wait_ns <= 0 or self.draining:
            return self._pulled(batch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ns / NS_PER_S
        waiter = _Waiter(eng, remaining_ns, loads, limit)
        eng.waiters.append(waiter)
        self._waiters.append(waiter)
        try:
            self._dispatch_all()
            refresh_s = self._fleet.settings.heartbeat_timeout_ms / 2000
            while True:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    async with asyncio.timeout(min(timeout, refresh_s)):
                        await waiter.event.wait()
                except TimeoutError:
                    # A parked pull keeps its engine alive (it quoted its incarnation).
                    if incarnation and self._engines.get(engine_id) is eng:
                        self._engine_for_pull(engine_id, incarnation)
                    continue
                waiter.event.clear()
                woken_for = self._unwake(waiter)
                if self._engines.get(engine_id) is not eng:
                    raise NotFound(f"engine_id: {engine_id!r} left the fleet")
                if self.draining:
                    break
                batch = self._take(eng, remaining_ns, loads, limit, lease)
                if batch.items:
                    return self._pulled(batch)
                if woken_for >= 0:
                    self._dispatch(woken_for)  # could not take after all: pass the wake on
        finally:
            self._waiters.remove(waiter)
            woken_for = self._unwake(waiter)
            if woken_for >= 0:  # woken but never ran: pass the wake on
                self._dispatch(woken_for)
            eng.waiters.remove(waiter)
        return self._pulled(Batch(tier=self.engine_tier(engine_id), items=(), quota_ns=0))

    def _pulled(self, batch: Batch) -> Batch:
        if batch.tier < 0:
            return batch
        tm = self._m[batch.tier]
        if batch.items:
            tm.pulls_batch.inc()
            tm.batch_requests.observe(len(batch.items))
            tm.batch_quota.observe(batch.quota_ns / NS_PER_S)
        else:
            tm.pulls_empty.inc()
        return batch

    def _wake(self, waiter: _Waiter, tier: int) -> None:
        waiter.woken = True
        waiter.woken_tier = tier
        self._woken[tier] += 1
        waiter.event.set()

    def _unwake(self, waiter: _Waiter) -> int:
        """Release a wake; returns the tier it was for (-1 when not woken)."""
        if not waiter.woken:
            return -1
        tier = waiter.woken_tier
        waiter.woken = False
        waiter.woken_tier = -1
        self._woken[tier] -= 1
        return tier

    def _dispatch_all(self) -> None:
        for t in range(self.n_tiers):
            self._dispatch(t)

    def _dispatch(self, tier: int) -> None:
        """Wake the waiting pull the balancer chooses for ``tier``'s work (one at a time)."""
        if self._woken[tier] > 0 or not self._waiters or not self._live_head(tier):
            return
        bal = self.balancer
        now = self._clock()
        offers = sorted(
            (
                w for w in self._waiters
                if not w.woken and bal.source_tier(w.engine.member_id, w.loads, now) == tier
            ),
            key=lambda w: w.engine.member_id,
        )
        i = bal.choose_puller(
            tier, [Offer(w.engine.member_id, w.remaining_ns, w.loads) for w in offers],
            now_ns=now,
        )
        if i >= 0:
            self._wake(offers[i], tier)

    def _live_head(self, tier: int) -> bool:
        """True when ``tier`` has a queued request whose caller still waits (cancelled
        ones at the head are dropped)."""
        while (head := self.balancer.head(tier)) is not None:
            rec = self._index[head.request_id]
            if not rec.future.done():
                return True
            self._drop(rec, "cancelled")
        return False

    def _alive(self, item: Queued) -> bool:
        return not self._index[item.request_id].future.done()

    def _take(
        self, eng: _Engine, remaining_ns: int, loads: list[int], limit: int, lease: bool
    ) -> Batch:
        """Let the balancer select and commit a batch for ``eng``; lease it (``lease``) or
        deliver it (may be empty). An engine offering no quota takes nothing."""
        if remaining_ns <= 0:
            return Batch(tier=self.engine_tier(eng.member_id), items=(), quota_ns=0)
        taken: Taken = self.balancer.take(
            eng.member_id, remaining_ns, loads, limit=limit or None, alive=self._alive,
            now_ns=self._clock(),
        )
        if taken.items:
            self.prefix.after_take(eng.member_id)
        for item in taken.dead:
            rec = self._index[item.request_id]
            self._forget(rec)
            self._outcome(rec, "cancelled")
        tier = taken.tier
        if not taken.items:
            return Batch(tier=tier, items=(), quota_ns=0)
        own = self.balancer.engine_tier(eng.member_id)
        if 0 <= own != tier:
            self._helped[tier][own].inc(len(taken.items))
        now = self._clock()
        items = []
        lease_ms = self.settings.lease_ms if lease else 0
        for item, rank in zip(taken.items, taken.ranks, strict=True):
            rec = self._index[item.request_id]
            rec.pulled_ns = now
            items.append(
                PulledItem(item.request_id, item.total, item.cached, rank, item.cost_ns)
            )
            if not lease:
                self._forget(rec)
                self._resolve(rec, Delivery(
                    eng.member_id, rank, tier, item.cost_ns, max(0, now - item.enqueued_ns)
                ))
        if lease:
            leased = self.leases.lease(
                eng.member_id, taken.items, taken.ranks, now + lease_ms * 1_000_000
            )
            asyncio.get_running_loop().call_later(
                lease_ms / 1000, self._lease_timer, leased
            )
            for t in {it.tier for it in taken.items}:
                self._gauge_leases(t)
        self._gauge_tier(tier)
        self._log.debug("prefill_batch", engine_id=eng.member_id, tier=tier, n=len(items))
        self._dispatch_all()
        return Batch(tier=tier, items=tuple(items), quota_ns=min(taken.quota_ns, MAX_U64),
                     lease_ms=lease_ms)

    # -- engines and rounds ----------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Prefill engines carry no heartbeat load: any load is refused."""
        raise InvalidArgument("load", "prefill engines report load in their pulls")

    def on_join(self, member: Member, now_ns: int) -> None:
        """A prefill engine joined: give it a tier at once."""
        shape = member.shape
        assert isinstance(shape, PrefillEngineShape)
        old = self._engines.get(member.member_id)
        if old is not None:
            self._end_waiters(old)
            # A new incarnation has lost what the old one held: deliver it elsewhere.
            self._requeue(self.leases.drop_engine(member.member_id), "engine_left")
        self._engines[member.member_id] = _Engine(
            member.member_id, member.incarnation, shape.dp_ranks, shape.step_quota_ns or 0
        )
        log.info("prefill_engine_joined", engine_id=member.member_id, dp_ranks=shape.dp_ranks)
        self.prefix.join(member.member_id, shape.prefix_cache_blocks,
                         cache_survived=shape.prefix_cache_survived)
        self._redistributed(self.balancer.add_engine(member.member_id, shape.dp_ranks))

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        """Unused: prefill engines report load in their pulls."""

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        """A prefill engine left: its waiting pulls end with NOT_FOUND; its share moves."""
        eng = self._engines.pop(member.member_id, None)
        if eng is None:
            return
        self._end_waiters(eng)
        log.info("prefill_engine_left", engine_id=member.member_id, reason=reason)
        red = self.balancer.remove_engine(member.member_id)
        self.prefix.leave(member.member_id, replaced=reason == "replaced")
        self._requeue(self.leases.drop_engine(member.member_id), "engine_left")
        if red is not None:
            self._redistributed(red)

    def _end_waiters(self, eng: _Engine) -> None:
        for waiter in list(eng.waiters):
            waiter.event.set()

    def rebalance(self, now_ns: int, reason: str = "round") -> list[int]:
        """Redistribute engines across tiers now; returns engines per tier.

        ``reason="round"`` closes a round (see
        :meth:`fulcrum.core.prefill.balancer.PrefillBalancer.redistribute`).
        """
        return list(self._redistributed(self.balancer.redistribute(reason, now_ns)).counts)

    def _redistributed(self, red: Redistribution) -> Redistribution:
        """Metrics and logs of a redistribution; wake pulls that may now take work."""
        m.ROUNDS.labels(red.reason).inc()
        if red.moves:
            m.MOVES.inc(red.moves)
        for t in range(self.n_tiers):
            self._m[t].engines.set(red.counts[t])
            if red.reason == "round":
                self._m[t].demand.set(red.demand_ns[t] / NS_PER_S)
        if red.moved:
            log.info(
                "prefill_engines_redistributed",
                reason=red.reason,
                engines=list(red.counts),
                moves=red.moves,
                demand_s=[round(d / NS_PER_S, 3) for d in red.demand_ns],
            )
        self._dispatch_all()
        return red

    def tick(self, now_ns: int) -> None:
        """Periodic job: close a round."""
        self.rebalance(now_ns, reason="round")

    # -- configuration reload --------------------------------------------------------------

    def apply_settings(self, new: PrefillSettings) -> bool:
        """Apply a reloaded section for real: batch caps, batch size, backlog rounds,
        hysteresis, rules, refit window and cost model at once; waits and chunk size are
        read from :attr:`settings` by every call that follows. Tier bounds cannot change
        while running (restart). Returns False when refused."""
        if tuple(new.tier_bounds) != self.bounds:
            log.warning("prefill_reload_refused", reason="tier_bounds change needs a restart")
            return False
        old = self.settings
        self.balancer.reconfigure(balancer_config(new))
        self.settings = new
        self.prefix.apply(new)
        if self._samples.maxlen != new.refit.window_samples:
            self._samples = deque(self._samples, maxlen=new.refit.window_samples)
        if new.cost_model != old.cost_model:
            cm = new.cost_model
            self.model = CostModel(a=cm.a, b=cm.b, k=cm.k)
            self.model_version += 1
            self._gauge_model()
            log.info("cost_model_configured", version=self.model_version, a=cm.a, b=cm.b, k=cm.k)
        self._dispatch_all()
        return True

    # -- drain -----------------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new submits, fail queued ones with UNAVAILABLE, end every long poll."""
        self.draining = True
        for rec in list(self._index.values()):
            if rec.future.done():
                self._drop(rec, "cancelled")
            else:
                self._drop(
                    rec,
                    "unavailable",
                    Unavailable("prefill: the daemon is draining; resubmit elsewhere"),
                )
        for waiter in self._waiters:
            waiter.event.set()

    # -- cost model ------------------------------------------------------------------------

    def report_samples(self, samples: Sequence[tuple[int, int, int]]) -> int:
        """Add measured ``(q, c, ns)`` step samples (tokens, tokens, ns) to the fit window."""
        limit = self.settings.refit.max_samples_per_report
        if len(samples) > limit:
            raise InvalidArgument("samples", f"must have at most {limit} entries")
        for i, (q, c, ns) in enumerate(samples):
            if not 1 <= q <= self.settings.max_total_tokens:
                raise InvalidArgument(f"samples[{i}].q", "must be in [1, max_total_tokens]")
            if not 0 <= c <= self.settings.max_total_tokens:
                raise InvalidArgument(f"samples[{i}].c", "must be in [0, max_total_tokens]")
            if ns <= 0:
                raise InvalidArgument(f"samples[{i}].measured_ns", "must be > 0")
        for q, c, ns in samples:
            self._samples.append((q, c, ns))
            predicted = self.model.cost(q, c)
            m.COST_REL_ERROR.observe(abs(predicted - ns) / ns)
        m.COST_SAMPLES.set(len(self._samples))
        return len(samples)

    def refit(self, now_ns: int) -> bool:
        """Refit from the window; adopt when better by the margin. True when adopted."""
        rs = self.settings.refit
        if not rs.enabled or len(self._samples) < rs.min_samples:
            m.COST_REFITS.labels("skipped").inc()
            return False
        arr = np.array(self._samples, dtype=np.float64)
        q, c, ns = arr[:, 0], arr[:, 1], arr[:, 2]
        try:
            new = fit(q, c, ns)
            old = evaluate(self.model, q, c, ns)
        except ValueError as err:
            log.warning("cost_model_refit_failed", error=str(err))
            m.COST_REFITS.labels("skipped").inc()
            return False
        m.COST_REL_ERROR_P90.set(old.rel_err_p90)
        if not should_adopt(old, new.quality, rs.adopt_margin):
            m.COST_REFITS.labels("kept").inc()
            return False
        previous = self.model
        self.model = new.model
        self.model_version += 1
        m.COST_REFITS.labels("adopted").inc()
        m.COST_REL_ERROR_P90.set(new.quality.rel_err_p90)
        self._gauge_model()
        log.info(
            "cost_model_adopted",
            version=self.model_version,
            a=new.model.a,
            b=new.model.b,
            k=new.model.k,
            old_a=previous.a,
            old_b=previous.b,
            old_k=previous.k,
            old_p90=round(old.rel_err_p90, 4),
            new_p90=round(new.quality.rel_err_p90, 4),
            r2=round(new.quality.r2, 4),
            samples=new.quality.n,
        )
        return True

    # -- metrics ---------------------------------------------------------------------------

    def _gauge_leases(self, tier: int) -> None:
        m.LEASED.set(len(self.leases))
        self._m[tier].leased_quota.set(self.leases.leased_ns[tier] / NS_PER_S)

    def _note_imbalance(self, engine_id: str, loads: Sequence[int]) -> None:
        """Observe max/mean of the rank loads a pull reports (not for idle engines), in
        the tier the engine serves."""
        if len(loads) < 2 or not any(loads):
            return
        total = sum(loads)
        tier = self.engine_tier(engine_id)
        if tier < 0:
            return
        self._m[tier].imbalance.observe(max(loads) * len(loads) / total)

    def _gauge_tier(self, tier: int) -> None:
        tm = self._m[tier]
        tm.depth.set(self.balancer.queue_depth(tier))
        tm.quota.set(self.balancer.queued_ns(tier) / NS_PER_S)

    def _gauge_model(self) -> None:
        m.COST_COEFFICIENT.labels("a").set(self.model.a)
        m.COST_COEFFICIENT.labels("b").set(self.model.b)
        m.COST_COEFFICIENT.labels("k").set(self.model.k)


def wait_ns(requested_ms: int, default_ms: int, max_ms: int) -> int:
    """The wait (ns) of a call: ``requested_ms`` (0 = default), capped at ``max_ms``."""
    ms = default_ms if requested_ms == 0 else requested_ms
    return int(min(ms, max_ms)) * 1_000_000

