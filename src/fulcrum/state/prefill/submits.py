"""The prefill shell's submit table: requests in flight and the outcomes kept for
idempotent re-submits.

A request is in flight from its submit until it ends exactly once: delivered (resolved
with its :class:`Delivery`, which is then retained ``retention_ms`` for a retried Submit),
or dropped -- cancelled by its callers, its wait expired, the daemon draining. The table
validates a submit, turns its fields into the core's queued item (:meth:`SubmitTable.item`,
the one place that does), bounds the block hashes held in flight, and owns each request's
future and wait timer. Only the event loop touches it; times are ns of the daemon's clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from fulcrum.core.prefill.balancer import Queued
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass
from fulcrum.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.metrics import prefill as m
from fulcrum.state.prefill.context import Part, Shell
from fulcrum.state.prefill.records import Delivery, Pending
from fulcrum.state.prefix import PrefixWiring
from fulcrum.state.retention import RetentionTable
from fulcrum.units import NS_PER_S

#: Called with (request_id, outcome, engine_id or "") when a request ends.
OutcomeHook = Callable[[str, str, str], None]


class SubmitTable(Part):
    """See module docstring. ``price(total, cached)``: the plain predicted cost (ns) of a
    request."""

    def __init__(self, shell: Shell, prefix: PrefixWiring,
                 price: Callable[[int, int], int]) -> None:
        super().__init__(shell)
        self._prefix = prefix
        self._price = price
        self.index: dict[str, Pending] = {}  # in flight: queued or leased
        self.held_hashes = 0  # block hashes of the requests in index
        #: Acknowledged requests kept for idempotent re-submits, bounded per submitter.
        self.done: RetentionTable[Delivery] = RetentionTable()
        #: Test/diagnostic hooks: called with (request_id, outcome, engine_id or "").
        self.hooks: list[OutcomeHook] = []

    # -- validation and idempotency ---------------------------------------------------------

    def validate(self, request_id: str, total: int, cached: int, *, draining: bool,
                 engines: int) -> int:
        """Raise the domain error of an invalid or refused submit; return its tier by
        length (``engines``: prefill engines registered now)."""
        s = self._settings()
        if total <= 0:
            raise InvalidArgument("total_tokens", "must be > 0")
        if total > s.max_total_tokens:
            raise InvalidArgument(
                "total_tokens", f"must be <= {s.max_total_tokens} (max_total_tokens)")
        if cached < 0:
            raise InvalidArgument("cached_tokens", "must be >= 0")
        if cached >= total:
            raise InvalidArgument("cached_tokens", "must be < total_tokens")
        if draining:
            raise Unavailable("prefill: the daemon is draining; resubmit elsewhere")
        if request_id in self.index:
            raise AlreadyExists(f"request_id: {request_id!r} is already queued")
        tier = self._bal.tier_of(total)
        if not engines:
            self._m.count(tier, "no_engine")
            raise Unavailable("prefill: no live prefill engine is registered; retry later",
                              retry_after_ms=s.no_engine_retry_after_ms)
        if self._bal.queue_depth(tier) >= s.max_queued_per_tier:
            self._m.count(tier, "queue_full")
            raise ResourceExhausted(
                f"prefill: tier {self._m.labels[tier]} queue is at its bound of "
                f"{s.max_queued_per_tier} requests",
                retry_after_ms=s.round_period_ms,
            )
        return tier

    def joining(self, request_id: str, total: int, cached: int) -> Pending | None:
        """The request in flight a re-submit joins (None when ``request_id`` is not in
        flight); ALREADY_EXISTS when the id is reused with other lengths."""
        rec = self.index.get(request_id)
        if rec is None:
            return None
        if rec.item.total != total or rec.item.cached != cached:
            raise AlreadyExists(
                f"request_id: {request_id!r} is in flight with other total_tokens or "
                "cached_tokens"
            )
        self._m.count(rec.tier, "duplicate")
        return rec

    def kept(self, request_id: str, total: int, cached: int, now_ns: int) -> Delivery | None:
        """The retained outcome a re-submit gets (None when none is kept);
        ALREADY_EXISTS when the id is reused with other lengths."""
        entry = self.done.get(request_id, now_ns)
        if entry is None:
            return None
        if entry.total != total or entry.cached != cached:
            raise AlreadyExists(
                f"request_id: {request_id!r} was acknowledged with other "
                "total_tokens or cached_tokens within prefill.retention_ms; its "
                "outcome is kept")
        self._m.count(entry.outcome.tier, "duplicate")
        return entry.outcome

    def retained(self, request_id: str) -> Delivery | None:
        """The acknowledged outcome kept for ``request_id`` (within the retention window),
        or None."""
        entry = self.done.get(request_id, self._clock())
        return None if entry is None else entry.outcome

    # -- admission --------------------------------------------------------------------------

    def item(self, request_id: str, total: int, cached: int, tier: int,
             block_hashes: Sequence[int], now_ns: int,
             cls: RequestClass = DEFAULT_CLASS) -> Queued:
        """The core's queued item of a validated submit (lengths in tokens, tier by
        length, enqueued at ``now_ns``, class ``cls``): its blocks, the tier it queues in
        and its predicted cost (ns). RESOURCE_EXHAUSTED when its block hashes would pass
        the in-flight bound."""
        blocks = self._prefix.blocks(block_hashes)
        self._check_hashes(len(blocks))
        tier = self._prefix.tier(total, blocks, tier)
        return Queued(
            request_id=request_id,
            total=total,
            cached=cached,
            tier=tier,
            cost_ns=self._prefix.cost(total, cached, blocks, self._price(total, cached)),
            enqueued_ns=now_ns,
            blocks=blocks,
            cls=cls,
        )

    def admit(self, item: Queued, submitter: str, wait_ns: int) -> Pending:
        """Put ``item`` in flight (its wait timer of ``wait_ns`` running; the caller
        queues it)."""
        loop = asyncio.get_running_loop()
        rec = Pending(item, loop.create_future(), submitter=submitter)
        self.index[item.request_id] = rec
        self.held_hashes += len(item.blocks)
        m.BLOCK_HASHES_HELD.set(self.held_hashes)
        rec.timer = loop.call_later(max(0.0, wait_ns / NS_PER_S), self.expire, rec)
        self._m.tenants.queued(item)
        self._m.tiers[item.tier].predicted.observe(item.cost_ns / NS_PER_S)
        return rec

    def reserve(self, submitter: str, now_ns: int) -> None:
        """RESOURCE_EXHAUSTED when the outcome of a new submit of ``submitter`` could not
        be retained (see :meth:`fulcrum.state.retention.RetentionTable.admit`)."""
        s = self._settings()
        self.done.admit(submitter, now_ns, s.max_retained, s.max_retained_per_submitter)

    def _check_hashes(self, n: int) -> None:
        """RESOURCE_EXHAUSTED when ``n`` more block hashes would pass the in-flight bound."""
        s = self._settings()
        bound = s.max_block_hashes_in_flight
        if n and self.held_hashes + n > bound:
            raise ResourceExhausted(
                f"prefill: the requests in flight carry {self.held_hashes} block hashes; "
                f"{n} more would pass prefill.max_block_hashes_in_flight ({bound})",
                retry_after_ms=s.round_period_ms,
            )

    # -- waiting and ending -----------------------------------------------------------------

    async def wait(self, rec: Pending, *, joined: bool) -> Delivery:
        """Wait on a request's outcome; the last caller to go cancels it."""
        if joined:
            rec.callers += 1
        try:
            return await asyncio.shield(rec.future)
        except asyncio.CancelledError:
            rec.callers -= 1
            if rec.callers <= 0 and self.index.get(rec.request_id) is rec:
                if not rec.future.done():
                    rec.future.cancel()
                self.drop(rec, "cancelled")
            raise

    def forget(self, rec: Pending) -> None:
        """Take ``rec`` out of the table (it is no longer in flight)."""
        del self.index[rec.request_id]
        self.held_hashes -= len(rec.item.blocks)
        m.BLOCK_HASHES_HELD.set(self.held_hashes)
        if rec.timer is not None:
            rec.timer.cancel()
            rec.timer = None

    def end(self, rec: Pending, outcome: str, error: Exception | None = None) -> None:
        """``rec`` (already out of queue and lease) ends undelivered with ``outcome``; its
        callers get ``error`` (when given)."""
        self.forget(rec)
        if error is not None and not rec.future.done():
            rec.future.set_exception(error)
        self._m.count(rec.tier, outcome)
        self._m.gauge_tier(rec.tier)
        for hook in self.hooks:
            hook(rec.request_id, outcome, "")

    def drop(self, rec: Pending, outcome: str, error: Exception | None = None) -> None:
        """Take a request out of its queue or lease without delivering it."""
        self._bal.remove(rec.request_id)
        self._m.tenants.left(rec.request_id)
        if self._leases.release(rec.request_id) is not None:
            self._m.leases["cancelled"].inc()
            self._m.gauge_leases(rec.tier)
        self.end(rec, outcome, error)

    def resolve(self, rec: Pending, delivery: Delivery) -> None:
        """Resolve a submit (exactly once; ``rec`` already forgotten) and keep its outcome
        for re-submits."""
        if not rec.future.done():
            rec.future.set_result(delivery)
        now = self._clock()
        s = self._settings()
        self.done.put(rec.request_id, rec.item.total, rec.item.cached, delivery,
                      now + s.retention_ms * 1_000_000, rec.submitter)
        self.done.purge(now)
        m.RETAINED.set(len(self.done))
        tiers = self._m.tiers
        tm = tiers[delivery.tier if 0 <= delivery.tier < len(tiers) else rec.tier]
        tm.wait.observe(delivery.waited_ns / NS_PER_S)
        self._m.count(rec.tier, "delivered")
        self._m.tenants.delivered(rec.item, delivery.waited_ns)
        for hook in self.hooks:
            hook(rec.request_id, "delivered", delivery.engine_id)

    def expire(self, rec: Pending) -> None:
        """``rec``'s wait ran out: it fails DEADLINE_EXCEEDED unless an engine holds it
        (then that engine's acknowledgement decides)."""
        if self.index.get(rec.request_id) is not rec:
            return
        if rec.future.done():  # its caller is gone
            self.drop(rec, "cancelled")
            return
        if rec.request_id in self._leases:
            # An engine holds it: its acknowledgement decides (exactly once); should the
            # lease end unacknowledged, the request fails instead of going back.
            rec.overdue = True
            rec.timer = None
            return
        waited_ms = (self._clock() - rec.item.enqueued_ns) // 1_000_000
        self._m.tenants.expired(rec.item)
        self.drop(rec, "deadline_exceeded", DeadlineExceeded(
            f"prefill: no engine took the request in {waited_ms} ms "
            f"(tier {self._m.labels[rec.tier]})"
        ))

    def cancelled(self, items: Iterable[Queued]) -> None:
        """The balancer dropped these queued items, whose callers were gone."""
        for item in items:
            self.end(self.index[item.request_id], "cancelled")

    def live_head(self, tier: int) -> bool:
        """True when ``tier`` has a queued request whose caller still waits (cancelled
        ones at the head are dropped)."""
        while (head := self._bal.head(tier)) is not None:
            rec = self.index[head.request_id]
            if not rec.future.done():
                return True
            self.drop(rec, "cancelled")
        return False

    def alive(self, item: Queued) -> bool:
        """True while the caller of queued ``item`` still waits."""
        return not self.index[item.request_id].future.done()

    def fail_all(self, error: Callable[[], Exception]) -> None:
        """Drop every request in flight: callers still waiting get ``error()``."""
        for rec in list(self.index.values()):
            if rec.future.done():
                self.drop(rec, "cancelled")
            else:
                self.drop(rec, "unavailable", error())
