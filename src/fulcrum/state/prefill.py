"""In-memory state of the prefill balancer: tier queues, engines, long polls, rounds, refit.

Life of a request (every transition is synchronous on the event loop, so each request is
in exactly one place at a time):

1. ``submit`` validates, predicts its cost with the model in force, queues it at the tail
   of its tier's FIFO queue and waits on a future.
2. It leaves the queue exactly once, by one of: being taken in a batch by an engine's
   pull (the future gets the :class:`Delivery`: outcome ``delivered``); its wait expiring
   (DEADLINE_EXCEEDED); its caller cancelling (``cancelled``); the daemon draining
   (UNAVAILABLE). A request whose caller has gone is never put in a batch.
3. Pulls are long polls: a pull that finds nothing it may take waits. When work arrives
   in a tier, the waiting engine of that tier with the most remaining quota that can take
   the head is woken (one at a time per tier); it takes its batch itself, then passes the
   wake on if work is left.

Engines follow the fleet (join/leave). Every round, engines are redistributed across
tiers by the previous round's quota demand (submitted + backlog share, ns); joins, leaves and
a tier receiving work with no engine ("orphan") trigger an immediate redistribution.
Engines report step times; a bounded window feeds a periodic refit of the cost model,
adopted only when better by the configured margin.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.cost import CostModel, evaluate, fit, should_adopt
from fulcrum.core.prefill.batch import pick_engine, select_batch
from fulcrum.core.prefill.ranks import assign_ranks
from fulcrum.core.prefill.tiers import (
    allocate,
    assign_engines,
    round_demand,
    tier_label,
    tier_of,
)
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

log = structlog.get_logger(__name__)

_MAX_U64 = (1 << 64) - 1
NS_PER_S = 1e9

#: Outcomes of a submitted request (label values of ``fulcrum_prefill_submits``).
OUTCOMES = ("delivered", "cancelled", "deadline_exceeded", "unavailable", "queue_full")


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
    """A pulled batch, FIFO order; ``quota_ns`` is the sum of predicted costs."""

    tier: int
    items: tuple[PulledItem, ...]
    quota_ns: int


@dataclass(slots=True, eq=False)
class _Queued:
    request_id: str
    total: int
    cached: int
    tier: int
    cost_ns: int
    enqueued_ns: int
    future: asyncio.Future[Delivery]
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True, eq=False)
class _Engine:
    member_id: str
    incarnation: int
    dp_ranks: int
    tier: int = -1
    waiters: list[_Waiter] = field(default_factory=list)
    #: Outstanding prefill work (ns, all ranks) as last known: the rank loads of the
    #: engine's latest pull plus what that pull delivered. Decides which engines change
    #: tiers at a rebalance (the emptiest move to the shortest tiers).
    load_ns: int = 0


@dataclass(slots=True, eq=False)
class _Waiter:
    engine: _Engine
    remaining_ns: int
    idle: bool
    max_requests: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    tier: int = -1  # tier list it is parked in, -1 when none
    woken: bool = False
    woken_tier: int = -1  # tier whose wake count it holds while woken


class _TierMetrics:
    """Label children of one tier, resolved once (``labels()`` is slow on hot paths)."""

    __slots__ = (
        "batch_quota",
        "batch_requests",
        "demand",
        "depth",
        "engines",
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
        self.demand = m.DEMAND.labels(label)
        self.predicted = m.PREDICTED_COST.labels(label)
        self.wait = m.WAIT.labels(label)
        self.batch_requests = m.BATCH_REQUESTS.labels(label)
        self.batch_quota = m.BATCH_QUOTA.labels(label)
        self.pulls_batch = m.PULLS.labels(label, "batch")
        self.pulls_empty = m.PULLS.labels(label, "empty")
        self.outcomes = {o: m.SUBMITS.labels(label, o) for o in OUTCOMES}


class PrefillState:
    """The prefill balancer's tables. One instance per daemon (``app.components["prefill"]``)."""

    def __init__(
        self,
        settings: PrefillSettings,
        fleet: Fleet,
        clock: Callable[[], int],
    ) -> None:
        self.settings = settings
        self._fleet = fleet
        self._clock = clock
        self.bounds = tuple(settings.tier_bounds)
        self.n_tiers = len(self.bounds) + 1
        self.labels = tuple(tier_label(self.bounds, t) for t in range(self.n_tiers))
        self.caps = tuple(settings.tier_batch_cap_ns)
        cm = settings.cost_model
        self.model = CostModel(a=cm.a, b=cm.b, k=cm.k)
        self.model_version = 1
        self._queues: list[OrderedDict[str, _Queued]] = [
            OrderedDict() for _ in range(self.n_tiers)
        ]
        self._index: dict[str, _Queued] = {}
        self._queued_ns = [0] * self.n_tiers
        self._arrived_ns = [0] * self.n_tiers  # quota submitted this round
        self.last_demand_ns: list[int] = [0] * self.n_tiers
        self._engines: dict[str, _Engine] = {}
        self._waiters: list[list[_Waiter]] = [[] for _ in range(self.n_tiers)]
        self._woken = [0] * self.n_tiers  # woken waiters not yet run, per tier
        self._samples: deque[tuple[int, int, int]] = deque(maxlen=settings.refit.window_samples)
        self.draining = False
        #: Test/diagnostic hooks: called with (request_id, outcome, engine_id or "").
        self.outcome_hooks: list[Callable[[str, str, str], None]] = []
        self.moves_total = 0
        self._counts = [0] * self.n_tiers  # engines per tier
        self._m = [_TierMetrics(label) for label in self.labels]
        self._log = log.bind()  # resolved once: per-request debug lines cost ~nothing
        for t in range(self.n_tiers):
            self._gauge_tier(t)
            self._m[t].engines.set(0)
        self._gauge_model()

    # -- queries ---------------------------------------------------------------------------

    def tier_of(self, total_tokens: int) -> int:
        """Tier index of a request of ``total_tokens`` context (tokens)."""
        return tier_of(total_tokens, self.bounds)

    def engines_per_tier(self) -> list[int]:
        """Engines assigned to each tier now."""
        return list(self._counts)

    def engine_tier(self, engine_id: str) -> int:
        """The tier an engine serves (-1 when unknown)."""
        eng = self._engines.get(engine_id)
        return -1 if eng is None else eng.tier

    def queue_depths(self) -> list[int]:
        """Requests queued in each tier."""
        return [len(q) for q in self._queues]

    def queued_ns(self) -> list[int]:
        """Predicted quota queued in each tier (ns)."""
        return list(self._queued_ns)

    def is_queued(self, request_id: str) -> bool:
        """True while ``request_id`` waits in a tier queue."""
        return request_id in self._index

    def waiting_pulls(self, tier: int) -> int:
        """Pulls currently long-polling on ``tier``."""
        return len(self._waiters[tier])

    def predict_ns(self, total: int, cached: int) -> int:
        """Predicted cost (ns) of prefilling ``total - cached`` tokens after ``cached``."""
        return min(_MAX_U64, self.model.cost_ns(total - cached, cached))

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
        if len(self._queues[tier]) >= self.settings.max_queued_per_tier:
            self._m[tier].outcomes["queue_full"].inc()
            raise ResourceExhausted(
                f"prefill: tier {self.labels[tier]} queue is at its bound of "
                f"{self.settings.max_queued_per_tier} requests",
                retry_after_ms=self.settings.round_period_ms,
            )
        return tier

    async def submit(
        self, request_id: str, total: int, cached: int, wait_ns: int
    ) -> Delivery:
        """Queue a request and wait until an engine pulls it (or it fails)."""
        tier = self.validate_submit(request_id, total, cached)
        now = self._clock()
        loop = asyncio.get_running_loop()
        item = _Queued(
            request_id=request_id,
            total=total,
            cached=cached,
            tier=tier,
            cost_ns=self.predict_ns(total, cached),
            enqueued_ns=now,
            future=loop.create_future(),
        )
        self._queues[tier][request_id] = item
        self._index[request_id] = item
        self._queued_ns[tier] += item.cost_ns
        self._arrived_ns[tier] += item.cost_ns
        item.timer = loop.call_later(max(0.0, wait_ns / NS_PER_S), self._expire, item)
        self._m[tier].predicted.observe(item.cost_ns / NS_PER_S)
        self._gauge_tier(tier)
        self._log.debug("prefill_queued", request_id=request_id, tier=tier, cost_ns=item.cost_ns)
        if self._counts[tier] == 0 and self._can_cover_all():
            self.rebalance(now, reason="orphan")
        self._dispatch(tier)
        try:
            return await item.future
        except asyncio.CancelledError:
            if self._index.get(request_id) is item:
                self._drop(item, "cancelled")
            raise

    def _can_cover_all(self) -> bool:
        """True when there are engines for every tier with demand (so an orphan tier can be
        given one at once without taking the last engine of another tier with demand;
        otherwise the next round decides, which avoids moving engines on every submit)."""
        with_demand = sum(
            1
            for t in range(self.n_tiers)
            if self._queued_ns[t] or self._arrived_ns[t] or self.last_demand_ns[t]
        )
        return 0 < with_demand <= len(self._engines)

    def _drop(self, item: _Queued, outcome: str, error: Exception | None = None) -> None:
        """Take a request out of its queue without delivering it."""
        self._unlink(item)
        if error is not None and not item.future.done():
            item.future.set_exception(error)
        self._m[item.tier].outcomes[outcome].inc()
        self._gauge_tier(item.tier)
        for hook in self.outcome_hooks:
            hook(item.request_id, outcome, "")

    def _unlink(self, item: _Queued) -> None:
        del self._queues[item.tier][item.request_id]
        del self._index[item.request_id]
        self._queued_ns[item.tier] -= item.cost_ns
        if item.timer is not None:
            item.timer.cancel()
            item.timer = None

    def _expire(self, item: _Queued) -> None:
        if self._index.get(item.request_id) is not item:
            return
        if item.future.done():  # its caller is gone
            self._drop(item, "cancelled")
            return
        waited_ms = (self._clock() - item.enqueued_ns) // 1_000_000
        self._drop(
            item,
            "deadline_exceeded",
            DeadlineExceeded(
                f"prefill: no engine took the request in {waited_ms} ms "
                f"(tier {self.labels[item.tier]})"
            ),
        )

    # -- pull ------------------------------------------------------------------------------

    def _engine_for_pull(self, engine_id: str, incarnation: int) -> _Engine:
        now = self._clock()
        if incarnation:  # a pull from the current incarnation also counts as a heartbeat
            member = self._fleet.heartbeat(engine_id, incarnation, None, now)
        else:
            member = self._fleet.get_live(engine_id, None, now)
        eng = self._engines.get(engine_id)
        if member.kind is not MemberKind.PREFILL_ENGINE or eng is None:
            raise NotFound(f"engine_id: {engine_id!r} is not a registered prefill engine")
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

    async def pull(
        self,
        engine_id: str,
        incarnation: int,
        remaining_ns: int,
        rank_loads_ns: Sequence[int],
        wait_ns: int,
        max_requests: int,
    ) -> Batch:
        """An engine's pull: a batch now, or after a long poll of up to ``wait_ns``."""
        eng = self.validate_pull(engine_id, incarnation, rank_loads_ns)
        loads = list(rank_loads_ns) if rank_loads_ns else [0] * eng.dp_ranks
        idle = not any(loads)
        eng.load_ns = sum(loads)
        limit = self.settings.max_batch_requests
        if max_requests > 0:
            limit = min(limit, max_requests)
        batch = self._take(eng, remaining_ns, loads, idle, limit)
        if batch.items or wait_ns <= 0 or self.draining:
            return self._pulled(batch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ns / NS_PER_S
        waiter = _Waiter(eng, remaining_ns, idle, limit)
        eng.waiters.append(waiter)
        try:
            while True:
                self._park(waiter)
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    async with asyncio.timeout(timeout):
                        await waiter.event.wait()
                except TimeoutError:
                    break
                waiter.event.clear()
                woken_for = self._unwake(waiter)
                if woken_for >= 0 and woken_for != eng.tier:
                    self._dispatch(woken_for)  # moved tiers meanwhile: pass the wake on
                if self._engines.get(engine_id) is not eng:
                    raise NotFound(f"engine_id: {engine_id!r} left the fleet")
                if self.draining:
                    break
                batch = self._take(eng, remaining_ns, loads, idle, limit)
                if batch.items:
                    return self._pulled(batch)
        finally:
            self._unpark(waiter)
            woken_for = self._unwake(waiter)
            if woken_for >= 0:  # woken but never ran: pass the wake on
                self._dispatch(woken_for)
            eng.waiters.remove(waiter)
        return self._pulled(Batch(tier=eng.tier, items=(), quota_ns=0))

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

    def _park(self, waiter: _Waiter, dispatch: bool = True) -> None:
        tier = waiter.engine.tier
        if waiter.tier != tier:
            self._unpark(waiter)
            if tier >= 0:
                self._waiters[tier].append(waiter)
                waiter.tier = tier
        if dispatch and tier >= 0:
            self._dispatch(tier)

    def _unpark(self, waiter: _Waiter) -> None:
        if waiter.tier >= 0:
            lst = self._waiters[waiter.tier]
            if waiter in lst:
                lst.remove(waiter)
            waiter.tier = -1

    def _wake(self, waiter: _Waiter, tier: int) -> None:
        self._unpark(waiter)
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

    def _dispatch(self, tier: int) -> None:
        """Wake the best waiting engine of ``tier`` if work is queued and nobody is woken."""
        queue = self._queues[tier]
        waiters = self._waiters[tier]
        if not queue or not waiters or self._woken[tier] > 0:
            return
        head = self._live_head(tier)
        if head is None:
            return
        cap = self.caps[tier]
        able = [
            w
            for w in sorted(waiters, key=lambda w: w.engine.member_id)
            if select_batch((head.cost_ns,), w.remaining_ns, cap, idle=w.idle) >= 1
        ]
        if able:
            best = able[pick_engine([w.remaining_ns for w in able])]
            self._wake(best, tier)

    def _live_head(self, tier: int) -> _Queued | None:
        """The first queued request whose caller still waits; cancelled ones are dropped."""
        queue = self._queues[tier]
        while queue:
            item = next(iter(queue.values()))
            if not item.future.done():
                return item
            self._drop(item, "cancelled")
        return None

    def _take(
        self, eng: _Engine, remaining_ns: int, loads: list[int], idle: bool, limit: int
    ) -> Batch:
        """Select, commit and deliver a batch for ``eng`` from its tier (may be empty)."""
        tier = eng.tier
        if tier < 0:
            return Batch(tier=tier, items=(), quota_ns=0)
        queue = self._queues[tier]
        live: list[_Queued] = []
        dead: list[_Queued] = []

        def costs() -> Iterator[int]:
            for item in queue.values():
                if item.future.done():
                    dead.append(item)
                    continue
                live.append(item)
                yield item.cost_ns

        n = select_batch(costs(), remaining_ns, self.caps[tier], idle=idle, max_requests=limit)
        for item in dead:
            self._drop(item, "cancelled")
        chosen = live[:n]
        if not chosen:
            return Batch(tier=tier, items=(), quota_ns=0)
        plan = assign_ranks(loads, [it.cost_ns for it in chosen])
        eng.load_ns = sum(plan.loads_ns)
        now = self._clock()
        items = []
        total_ns = 0
        tm = self._m[tier]
        for item, rank in zip(chosen, plan.ranks, strict=True):
            self._unlink(item)
            waited = max(0, now - item.enqueued_ns)
            item.future.set_result(
                Delivery(eng.member_id, rank, tier, item.cost_ns, waited)
            )
            items.append(
                PulledItem(item.request_id, item.total, item.cached, rank, item.cost_ns)
            )
            total_ns += item.cost_ns
            tm.wait.observe(waited / NS_PER_S)
            for hook in self.outcome_hooks:
                hook(item.request_id, "delivered", eng.member_id)
        tm.outcomes["delivered"].inc(len(items))
        self._gauge_tier(tier)
        self._log.debug("prefill_batch", engine_id=eng.member_id, tier=tier, n=len(items))
        if queue:
            self._dispatch(tier)
        return Batch(tier=tier, items=tuple(items), quota_ns=min(total_ns, _MAX_U64))

    # -- engines and rounds ----------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Prefill engines carry no heartbeat load: any load is refused."""
        raise InvalidArgument("load", "prefill engines report load in their pulls")

    def on_join(self, member: Member, now_ns: int) -> None:
        """A prefill engine joined: give it a tier at once."""
        shape = member.shape
        assert isinstance(shape, PrefillEngineShape)
        self._engines[member.member_id] = _Engine(
            member.member_id, member.incarnation, shape.dp_ranks
        )
        log.info("prefill_engine_joined", engine_id=member.member_id, dp_ranks=shape.dp_ranks)
        self.rebalance(now_ns, reason="join")

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        """Unused: prefill engines report load in their pulls."""

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        """A prefill engine left: its waiting pulls end with NOT_FOUND; its share moves."""
        eng = self._engines.pop(member.member_id, None)
        if eng is None:
            return
        if eng.tier >= 0:
            self._counts[eng.tier] -= 1
        for waiter in list(eng.waiters):
            self._unpark(waiter)
            waiter.event.set()
        log.info("prefill_engine_left", engine_id=member.member_id, reason=reason)
        self.rebalance(now_ns, reason="leave")

    def rebalance(self, now_ns: int, reason: str = "round") -> list[int]:
        """Redistribute engines across tiers; returns engines per tier.

        ``reason="round"`` closes a round: each tier's demand is the quota submitted to it
        this round plus its queued quota spread over ``backlog_rounds`` rounds (ns;
        :func:`fulcrum.core.prefill.tiers.round_demand`) and becomes the previous round's
        demand. Other reasons (join, leave, orphan) redistribute at once with the larger
        of the previous round's demand and the current round's so far.
        """
        current = round_demand(
            self._arrived_ns, self._queued_ns, self.settings.backlog_rounds
        ).tolist()
        if reason == "round":
            demand = current
            self.last_demand_ns = [int(x) for x in current]
            self._arrived_ns = [0] * self.n_tiers
            for t in range(self.n_tiers):
                self._m[t].demand.set(current[t] / NS_PER_S)
        else:
            demand = [max(a, b) for a, b in zip(self.last_demand_ns, current, strict=True)]
        previous = {e.member_id: e.tier for e in self._engines.values() if e.tier >= 0}
        prev_counts = np.array(self.engines_per_tier(), dtype=np.int64)
        counts = allocate(
            len(self._engines),
            np.array(demand, dtype=np.float64),
            prev_counts if len(previous) == len(self._engines) else None,
            hysteresis=self.settings.hysteresis,
        )
        loads = {e.member_id: e.load_ns for e in self._engines.values()}
        result = assign_engines(list(self._engines), previous, counts, loads)
        moved: list[tuple[str, int, int]] = []
        for engine_id, tier in result.tiers.items():
            eng = self._engines[engine_id]
            if eng.tier != tier:
                moved.append((engine_id, eng.tier, tier))
                eng.tier = tier
                for waiter in eng.waiters:  # re-park under the new tier
                    if not waiter.woken:
                        self._park(waiter, dispatch=False)
        m.ROUNDS.labels(reason).inc()
        if result.moves:
            self.moves_total += result.moves
            m.MOVES.inc(result.moves)
        final = [int(x) for x in counts.tolist()]
        self._counts = list(final)
        for t in range(self.n_tiers):
            self._m[t].engines.set(final[t])
        if moved:
            log.info(
                "prefill_engines_redistributed",
                reason=reason,
                engines=final,
                moves=result.moves,
                demand_s=[round(d / NS_PER_S, 3) for d in demand],
            )
        for t in range(self.n_tiers):
            self._dispatch(t)
        return final

    def tick(self, now_ns: int) -> None:
        """Periodic job: close a round."""
        self.rebalance(now_ns, reason="round")

    # -- configuration reload --------------------------------------------------------------

    def apply_settings(self, new: PrefillSettings) -> bool:
        """Apply a reloaded section. Tier bounds cannot change while running (restart);
        everything else applies at once. A changed cost model in the file is adopted
        (new version). Returns False when refused."""
        if tuple(new.tier_bounds) != self.bounds:
            log.warning("prefill_reload_refused", reason="tier_bounds change needs a restart")
            return False
        old = self.settings
        self.settings = new
        self.caps = tuple(new.tier_batch_cap_ns)
        if self._samples.maxlen != new.refit.window_samples:
            self._samples = deque(self._samples, maxlen=new.refit.window_samples)
        if new.cost_model != old.cost_model:
            cm = new.cost_model
            self.model = CostModel(a=cm.a, b=cm.b, k=cm.k)
            self.model_version += 1
            self._gauge_model()
            log.info("cost_model_configured", version=self.model_version, a=cm.a, b=cm.b, k=cm.k)
        for t in range(self.n_tiers):
            self._dispatch(t)
        return True

    # -- drain -----------------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new submits, fail queued ones with UNAVAILABLE, end every long poll."""
        self.draining = True
        for queue in self._queues:
            for item in list(queue.values()):
                if item.future.done():
                    self._drop(item, "cancelled")
                else:
                    self._drop(
                        item,
                        "unavailable",
                        Unavailable("prefill: the daemon is draining; resubmit elsewhere"),
                    )
        for eng in self._engines.values():
            for waiter in eng.waiters:
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

    def _gauge_tier(self, tier: int) -> None:
        tm = self._m[tier]
        tm.depth.set(len(self._queues[tier]))
        tm.quota.set(self._queued_ns[tier] / NS_PER_S)

    def _gauge_model(self) -> None:
        m.COST_COEFFICIENT.labels("a").set(self.model.a)
        m.COST_COEFFICIENT.labels("b").set(self.model.b)
        m.COST_COEFFICIENT.labels("k").set(self.model.k)


def wait_ns(requested_ms: int, default_ms: int, max_ms: int) -> int:
    """The wait (ns) of a call: ``requested_ms`` (0 = default), capped at ``max_ms``."""
    ms = default_ms if requested_ms == 0 else requested_ms
    return int(min(ms, max_ms)) * 1_000_000

