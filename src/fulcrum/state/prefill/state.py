"""The prefill balancer's daemon shell: :class:`PrefillState` composes the parts.

* :class:`~fulcrum.state.prefill.submits.SubmitTable`: requests in flight, idempotency and
  retention; the one place a submit's fields become a core item.
* :class:`~fulcrum.state.prefill.leasebook.LeaseBook`: leases and acknowledgements.
* :class:`~fulcrum.state.prefill.dispatcher.Dispatcher`: long polls and who is woken.
* :class:`~fulcrum.state.prefill.refit.CostRefitter`: the cost model and its refit.
* :class:`~fulcrum.state.prefill.export.PrefillMetrics`: the metrics export.

What is left here: the engines following the fleet (join/leave), rounds, a pull's
validation and taking, reload and drain, and the queries the service and tests read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import structlog

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.cost import CostModel
from fulcrum.core.prefill.balancer import PrefillBalancer, Redistribution
from fulcrum.core.prefill.items import Queued
from fulcrum.core.prefill.leases import Lease, LeaseTable
from fulcrum.core.prefill.shed import shed_check
from fulcrum.core.prefill.tiers import tier_label
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass, TenantTable
from fulcrum.core.types import Member, MemberLoad, PrefillEngineShape
from fulcrum.errors import InvalidArgument, ResourceExhausted, Unavailable
from fulcrum.metrics.tenants import PrefillMeter
from fulcrum.state.fleet import Fleet
from fulcrum.state.prefill.adopt import Adopter, Held
from fulcrum.state.prefill.context import Shell
from fulcrum.state.prefill.dispatcher import Dispatcher
from fulcrum.state.prefill.engines import EngineRoster, check_band_loads
from fulcrum.state.prefill.export import PrefillMetrics
from fulcrum.state.prefill.leasebook import LeaseBook
from fulcrum.state.prefill.records import (
    AckReply,
    Assignment,
    Batch,
    Delivery,
    Engine,
    Pending,
    Waiter,
    balancer_config,
)
from fulcrum.state.prefill.refit import CostRefitter
from fulcrum.state.prefill.submits import OutcomeHook, SubmitTable
from fulcrum.state.prefix import PrefixWiring
from fulcrum.state.retention import RetentionTable
from fulcrum.units import MAX_U64, NS_PER_S

log = structlog.get_logger("fulcrum.state.prefill")


class PrefillState:
    """The prefill balancer's daemon shell. One per daemon (``app.components["prefill"]``)."""

    def __init__(self, settings: PrefillSettings, fleet: Fleet,
                 clock: Callable[[], int], tenants: TenantTable | None = None) -> None:
        self.settings = settings
        self._clock = clock
        self.tenants = tenants or TenantTable()  # the daemon's (issue 23)
        self.balancer = PrefillBalancer(balancer_config(settings, self.tenants.policy))
        self.bounds = self.balancer.bounds
        self.n_tiers = self.balancer.n_tiers
        self.labels = tuple(tier_label(self.bounds, t) for t in range(self.n_tiers))
        self.leases = LeaseTable(self.n_tiers)
        self.metrics = PrefillMetrics(self.labels, self.balancer, self.leases)
        self.metrics.tenants = PrefillMeter(self.tenants.label)
        self.cost = CostRefitter(settings, self.metrics)
        self.prefix = PrefixWiring(self.balancer, settings, self.cost.cost_ns, self.labels)
        # the parts read settings, clock and draining through the state: a reload (and a
        # test that swaps ``_clock``) applies to all of them at once
        shell = Shell(self.balancer, self.leases, self.metrics, lambda: self.settings,
                      self._now)
        self.submits = SubmitTable(shell, self.prefix, self.predict_ns)
        self.dispatcher = Dispatcher(self.balancer, self._now, self.submits.live_head,
                                     lambda: self.draining)
        self.lease_book = LeaseBook(shell, self.submits, self.dispatcher.dispatch_all)
        self.roster = EngineRoster(fleet, self._now)
        self.adopter = Adopter(shell, self.submits, self.lease_book)
        #: Pulls take nothing before this time (ns): a new leader's grace for engines to
        #: re-register and declare what they hold (:meth:`hold`).
        self.hold_until_ns = 0
        self.draining = False
        #: Test/diagnostic hooks: called with (request_id, outcome, engine_id or "").
        self.outcome_hooks: list[OutcomeHook] = self.submits.hooks
        self._log = log.bind()  # resolved once: per-request debug lines cost ~nothing
        for t in range(self.n_tiers):
            self.metrics.gauge_tier(t)

    def _now(self) -> int:
        return self._clock()

    # -- queries ---------------------------------------------------------------------------

    @property
    def model(self) -> CostModel:
        """The cost model in force."""
        return self.cost.model

    @property
    def model_version(self) -> int:
        """Bumped each time a cost model is adopted (refit or reload)."""
        return self.cost.version

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
        return len(self.submits.index)

    def waiting_pulls(self, tier: int) -> int:
        """Pulls currently long-polling (not woken) by engines of ``tier``."""
        return self.dispatcher.waiting(tier)

    def model_cost_ns(self, q: int, c: int) -> int:
        """The live cost model (ns, with ``k``) of ``q`` tokens after ``c`` cached."""
        return self.cost.cost_ns(q, c)

    def predict_ns(self, total: int, cached: int) -> int:
        """Predicted cost (ns, with ``k``) of prefilling ``total - cached`` tokens after
        ``cached``."""
        return min(MAX_U64, self.cost.model.cost_ns(total - cached, cached))

    def assignment(self, engine_id: str) -> Assignment:
        """The engine's tier, horizon and step budget now (see :class:`Assignment`)."""
        tier = self.engine_tier(engine_id)
        own = self.roster.step_quota_ns(engine_id)
        s = self.settings
        horizon = s.horizons_ns()[tier] if tier >= 0 else 0
        return Assignment(tier, self.labels[tier] if tier >= 0 else "", horizon,
                          own or s.step_quota_ns)

    def retained(self, request_id: str) -> Delivery | None:
        """The acknowledged outcome kept for ``request_id`` (within the retention window),
        or None."""
        return self.submits.retained(request_id)

    # The parts' tables under their former names (tests drive these directly).

    @property
    def _engines(self) -> dict[str, Engine]:
        return self.roster.engines

    @property
    def _index(self) -> dict[str, Pending]:
        return self.submits.index

    @property
    def _done(self) -> RetentionTable[Delivery]:
        return self.submits.done

    @property
    def _woken(self) -> list[int]:
        return self.dispatcher.woken

    def _expire(self, rec: Pending) -> None:
        self.submits.expire(rec)

    def _lease_timer(self, leases: list[Lease]) -> None:
        self.lease_book.expire(leases)

    # -- submit ----------------------------------------------------------------------------

    def validate_submit(self, request_id: str, total: int, cached: int) -> int:
        """Raise the domain error of an invalid or refused submit; return its tier."""
        return self.submits.validate(request_id, total, cached, draining=self.draining,
                                     engines=len(self.roster))

    async def submit(
        self, request_id: str, total: int, cached: int, wait_ns: int,
        block_hashes: Sequence[int] = (),
        submitter: str = "",
        cls: RequestClass = DEFAULT_CLASS,
    ) -> Delivery:
        """Queue a request of class ``cls`` and wait until an engine acknowledges it (or
        it fails; a shed intent of the core refuses it at once: :func:`refuse_if_shed`).

        Idempotent: the same id with the same lengths joins the request in flight, or
        gets the retained outcome of an acknowledged one; another request reusing an id in
        flight is ALREADY_EXISTS."""
        joined = self.submits.joining(request_id, total, cached)
        if joined is not None:
            return await self.submits.wait(joined, joined=True)
        now = self._clock()
        kept = self.submits.kept(request_id, total, cached, now)
        if kept is not None:
            return kept
        tier = self.validate_submit(request_id, total, cached)
        self.submits.reserve(submitter, now)
        item = self.submits.item(request_id, total, cached, tier, block_hashes, now, cls)
        refuse_if_shed(self.balancer, self.tenants, self.metrics.tenants, item)
        rec = self.submits.admit(item, submitter, wait_ns)
        red = self.balancer.enqueue(item)
        self.metrics.gauge_tier(item.tier)
        self._log.debug("prefill_queued", request_id=request_id, tier=item.tier,
                        cost_ns=item.cost_ns)
        if red is not None:
            self._redistributed(red)
        else:
            self.dispatcher.dispatch(item.tier)
        return await self.submits.wait(rec, joined=False)

    # -- pull ------------------------------------------------------------------------------

    def validate_pull(
        self, engine_id: str, incarnation: int, rank_loads_ns: Sequence[int]
    ) -> Engine:
        """The live engine of a pull, or NotFound / InvalidArgument."""
        return self.roster.puller(engine_id, incarnation, rank_loads_ns)

    def _check_acks(self, request_ids: Sequence[str]) -> None:
        limit = self.settings.max_batch_requests
        if len(request_ids) > limit:
            raise InvalidArgument(
                "ack_request_ids", f"must have at most {limit} entries (max_batch_requests)"
            )

    def ack(self, engine_id: str, incarnation: int, request_ids: Sequence[str]) -> AckReply:
        """``engine_id`` accepted these leased requests: each resolves its submit with this
        engine and its DP rank. Ids not leased to it (expired and re-queued, submitter
        gone, unknown) are refused: the engine must not run them."""
        self._check_acks(request_ids)
        eng = self.roster.caller(engine_id, incarnation)
        return self.lease_book.ack(eng.member_id, request_ids)

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
        band_loads: Mapping[float, Sequence[int]] | None = None,
    ) -> Batch:
        """An engine's pull: a batch now, or after a long poll of up to ``wait_ns``.

        ``ack_ids`` are acknowledged first (refusals come back in ``Batch.rejected``).
        ``lease``: a leased batch (else handing it over acknowledges it); ``band_loads``:
        :mod:`fulcrum.core.prefill.bands` (ns)."""
        eng = self.validate_pull(engine_id, incarnation, rank_loads_ns)
        bands = check_band_loads(eng, rank_loads_ns, band_loads, self.balancer.config.tenants)
        if lease and not rank_loads_ns:
            raise InvalidArgument(
                "rank_loads_ns",
                f"required with acknowledged delivery: {eng.dp_ranks} entries, one per DP "
                "rank (0 for an idle rank); only ack_on_reply pulls may omit it",
            )
        self._check_acks(ack_ids)
        rejected = self.lease_book.ack(eng.member_id, ack_ids).rejected
        loads = [int(x) for x in rank_loads_ns] if rank_loads_ns else [0] * eng.dp_ranks
        self.metrics.imbalance(self.engine_tier(engine_id), loads)
        waiter = Waiter(eng, remaining_ns, loads, max(max_requests, 0), bands)
        batch = self.metrics.pulled(await self._pull(waiter, incarnation, wait_ns, lease))
        if rejected:
            batch = Batch(batch.tier, batch.items, batch.quota_ns, rejected, batch.lease_ms)
        return batch

    async def _pull(self, waiter: Waiter, incarnation: int, wait_ns: int,
                    lease: bool) -> Batch:
        eng = waiter.engine
        take = partial(self._take, waiter, lease)
        batch = take()
        if batch.items or wait_ns <= 0 or self.draining:
            return batch
        parked = await self.dispatcher.park(waiter, wait_ns, self.roster.refresh_s(), take,
                                            partial(self.roster.keepalive, eng, incarnation))
        if parked is not None:
            return parked
        return Batch(tier=self.engine_tier(eng.member_id), items=(), quota_ns=0)

    def _take(self, waiter: Waiter, lease: bool) -> Batch:
        """Let the balancer select and commit a batch for the pull's engine; lease it
        (``lease``) or deliver it (may be empty). An engine offering no quota takes
        nothing (unless it reports band loads); nor does any before :attr:`hold_until_ns`."""
        eng_id = waiter.engine.member_id
        if waiter.offers_nothing or self._clock() < self.hold_until_ns:
            return Batch(tier=self.engine_tier(eng_id), items=(), quota_ns=0)
        taken = self.balancer.take(
            eng_id, waiter.remaining_ns, waiter.loads, limit=waiter.max_requests or None,
            alive=self.submits.alive, now_ns=self._clock(), band_loads=waiter.band_loads,
        )
        if taken.items:
            self.prefix.after_take(eng_id)
        self.metrics.tenants.took((*taken.items, *taken.dead))
        self.submits.cancelled(taken.dead)
        if not taken.items:
            return Batch(tier=taken.tier, items=(), quota_ns=0)
        self.metrics.helped(taken, self.engine_tier(eng_id))
        batch = self.lease_book.hand_over(eng_id, taken, lease)
        self.metrics.gauge_tier(taken.tier)
        self._log.debug("prefill_batch", engine_id=eng_id, tier=taken.tier,
                        n=len(batch.items))
        self.dispatcher.dispatch_all()
        return batch

    # -- engines and rounds ----------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Prefill engines carry no heartbeat load: any load is refused."""
        raise InvalidArgument("load", "prefill engines report load in their pulls")

    def on_join(self, member: Member, now_ns: int) -> None:
        """A prefill engine joined: give it a tier at once."""
        shape = member.shape
        assert isinstance(shape, PrefillEngineShape)
        eid, old = member.member_id, self.roster.join(member)
        if old is not None:
            self.dispatcher.end(old)
            # A new incarnation has lost what the old one held: deliver it elsewhere.
            self.lease_book.drop_engine(eid)
        log.info("prefill_engine_joined", engine_id=eid, dp_ranks=shape.dp_ranks)
        self.prefix.join(eid, shape.prefix_cache_blocks, cache_survived=shape.prefix_cache_survived)
        self._redistributed(self.balancer.add_engine(eid, shape.dp_ranks, shape.step_quota_ns))

    def adopt(self, engine_id: str, held: Sequence[Held]) -> int:
        """``engine_id`` (just registered) still holds ``held`` from a daemon that is
        gone: answer or retain them with it (:mod:`fulcrum.state.prefill.adopt`)."""
        if not held:
            return 0
        n = self.adopter.adopt(engine_id, held)
        log.info("prefill_held_adopted", engine_id=engine_id, declared=len(held), adopted=n)
        return n

    def hold(self, ms: int) -> None:
        """Take nothing for ``ms`` from now (a new leader's grace, so that engines
        declare what they hold before queued requests are handed out); then wake the
        parked pulls."""
        if ms <= 0:
            return
        self.hold_until_ns = self._clock() + ms * 1_000_000
        log.info("prefill_pulls_held", ms=ms, reason="engines re-register and declare "
                 "what they hold")
        asyncio.get_running_loop().call_later(ms / 1000, self.dispatcher.dispatch_all)

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        """Unused: prefill engines report load in their pulls."""

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        """A prefill engine left: its waiting pulls end with NOT_FOUND; its share moves."""
        eng = self.roster.leave(member.member_id)
        if eng is None:
            return
        self.dispatcher.end(eng)
        log.info("prefill_engine_left", engine_id=member.member_id, reason=reason)
        red = self.balancer.remove_engine(member.member_id)
        self.prefix.leave(member.member_id, replaced=reason == "replaced")
        self.lease_book.drop_engine(member.member_id)
        if red is not None:
            self._redistributed(red)

    def rebalance(self, now_ns: int, reason: str = "round") -> list[int]:
        """Redistribute engines across tiers now; returns engines per tier.

        ``reason="round"`` closes a round (see
        :meth:`fulcrum.core.prefill.balancer.PrefillBalancer.redistribute`).
        """
        return list(self._redistributed(self.balancer.redistribute(reason, now_ns)).counts)

    def _redistributed(self, red: Redistribution) -> Redistribution:
        """Metrics and logs of a redistribution; wake pulls that may now take work."""
        self.metrics.redistributed(red)
        if red.moved:
            log.info(
                "prefill_engines_redistributed",
                reason=red.reason,
                engines=list(red.counts),
                moves=red.moves,
                demand_s=[round(d / NS_PER_S, 3) for d in red.demand_ns],
            )
        self.dispatcher.dispatch_all()
        return red

    def tick(self, now_ns: int) -> None:
        """Periodic job: close a round."""
        self.rebalance(now_ns, reason="round")

    # -- reload, drain, cost model ---------------------------------------------------------

    def apply_settings(self, new: PrefillSettings) -> bool:
        """Apply a reloaded section for real: batch caps, batch size, backlog rounds,
        hysteresis, rules, refit window and cost model at once; waits and chunk size are
        read from :attr:`settings` by every call that follows. Tier bounds cannot change
        while running (restart). Returns False when refused."""
        if tuple(new.tier_bounds) != self.bounds:
            log.warning("prefill_reload_refused", reason="tier_bounds change needs a restart")
            return False
        self.balancer.reconfigure(balancer_config(new, self.tenants.policy))
        self.settings = new
        self.prefix.apply(new)
        self.cost.apply(new)
        self.dispatcher.dispatch_all()
        return True

    def drain(self) -> None:
        """Refuse new submits, fail queued ones with UNAVAILABLE, end every long poll."""
        self.draining = True
        self.submits.fail_all(
            lambda: Unavailable("prefill: the daemon is draining; resubmit elsewhere"))
        self.dispatcher.end_all()

    def report_samples(self, samples: Sequence[tuple[int, int, int]]) -> int:
        """Add measured ``(q, c, ns)`` step samples (tokens, tokens, ns) to the fit window."""
        return self.cost.report(samples)

    def refit(self, now_ns: int) -> bool:
        """Refit from the window; adopt when better by the margin. True when adopted."""
        return self.cost.refit()


def refuse_if_shed(balancer: PrefillBalancer, tenants: TenantTable, meter: PrefillMeter,
                   item: Queued) -> None:
    """RESOURCE_EXHAUSTED (counted), before anything changes, when the core sheds
    ``item``: a sheddable class whose predicted TTFT misses its deadline
    (:func:`fulcrum.core.prefill.shed.shed_check`)."""
    if item.cls.ttft_slo_ns is None:
        return
    intent = shed_check(balancer, item, tenants.sheddable(item.cls))
    if intent is None:
        return
    meter.shed(item.cls)
    raise ResourceExhausted(
        f"prefill: predicted TTFT {intent.predicted_ns // 1_000_000} ms misses the "
        f"deadline ({intent.budget_ns // 1_000_000} ms) of a sheddable class",
        retry_after_ms=intent.retry_after_ms)
