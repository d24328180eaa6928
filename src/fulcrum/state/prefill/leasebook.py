"""Leases and acknowledgements of pulled prefill batches.

A batch pulled with acknowledged delivery is leased to its engine for ``lease_ms``: each
request resolves its submit when the engine acknowledges it, and goes back to the head of
its tier when the lease runs out or the engine leaves first (failing instead when its own
wait ran out meanwhile). A batch pulled ``ack_on_reply`` resolves at once. The lease
bookkeeping itself is the core's :class:`fulcrum.core.prefill.leases.LeaseTable`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import structlog

from fulcrum.core.prefill.balancer import Taken
from fulcrum.core.prefill.bands import split_band
from fulcrum.core.prefill.leases import Lease, requeue_order
from fulcrum.errors import DeadlineExceeded
from fulcrum.state.prefill.context import Part, Shell
from fulcrum.state.prefill.records import AckReply, Batch, Delivery, PulledItem
from fulcrum.state.prefill.submits import SubmitTable
from fulcrum.units import MAX_U64

log = structlog.get_logger(__name__)


class LeaseBook(Part):
    """See module docstring. ``wake_all()`` is called after requests went back to their
    queues (pulls may now take them)."""

    def __init__(self, shell: Shell, submits: SubmitTable,
                 wake_all: Callable[[], None]) -> None:
        super().__init__(shell)
        self._submits = submits
        self._wake_all = wake_all
        self._log = log.bind()

    def hand_over(self, engine_id: str, taken: Taken, lease: bool) -> Batch:
        """The reply of a pull that took ``taken`` (not empty): leased for ``lease_ms``
        (``lease``), else every request resolves now."""
        tier = taken.tier
        now = self._clock()
        index = self._submits.index
        items = []
        lease_ms = self._settings().lease_ms if lease else 0
        for item, rank, band in zip(taken.items, taken.ranks, taken.bands, strict=True):
            rec = index[item.request_id]
            rec.pulled_ns = now
            items.append(
                PulledItem(item.request_id, item.total, item.cached, rank, item.cost_ns,
                           item.cls.priority, split_band(band)[1]))
            if not lease:
                self._submits.forget(rec)
                self._submits.resolve(rec, Delivery(
                    engine_id, rank, tier, item.cost_ns, max(0, now - item.enqueued_ns)))
        if lease:
            leased = self._leases.lease(
                engine_id, taken.items, taken.ranks, now + lease_ms * 1_000_000)
            asyncio.get_running_loop().call_later(lease_ms / 1000, self.expire, leased)
            for t in {it.tier for it in taken.items}:
                self._m.gauge_leases(t)
        return Batch(tier=tier, items=tuple(items), quota_ns=min(taken.quota_ns, MAX_U64),
                     lease_ms=lease_ms)

    def ack(self, engine_id: str, request_ids: Sequence[str]) -> AckReply:
        """``engine_id`` accepted these leased requests: each resolves its submit with this
        engine and its DP rank; the others are refused (a retried acknowledgement of a
        request this engine already acknowledged is not)."""
        if not request_ids:
            return AckReply(0, ())
        res = self._leases.ack(engine_id, request_ids, self._clock())
        tiers: set[int] = set()
        for lease in res.accepted:
            rec = self._submits.index[lease.request_id]
            self._submits.forget(rec)
            item = lease.item
            tiers.add(item.tier)
            self._submits.resolve(rec, Delivery(
                engine_id, lease.dp_rank, item.tier, item.cost_ns,
                max(0, rec.pulled_ns - item.enqueued_ns),
            ))
        if res.accepted:
            self._m.leases["acknowledged"].inc(len(res.accepted))
        rejected = tuple(
            rid for rid in res.rejected
            if (d := self._submits.retained(rid)) is None or d.engine_id != engine_id
        )  # a retried acknowledgement (lost reply) of a request this engine holds is fine
        if rejected:
            self._m.leases["rejected_ack"].inc(len(rejected))
            self._log.info("prefill_ack_rejected", engine_id=engine_id, n=len(rejected))
        for t in tiers:
            self._m.gauge_leases(t)
        return AckReply(len(res.accepted), rejected)

    def expire(self, leases: list[Lease]) -> None:
        """A batch's lease ran out: unacknowledged requests go back to the head."""
        current = [x for x in leases if self._leases.get(x.request_id) is x]
        for x in current:
            self._leases.release(x.request_id)
        self.requeue(current, "expired")

    def drop_engine(self, engine_id: str) -> None:
        """``engine_id`` left (or lost what it held): its leases go back."""
        self.requeue(self._leases.drop_engine(engine_id), "engine_left")

    def requeue(self, leases: Sequence[Lease], reason: str) -> None:
        """Put unacknowledged leased requests back at the head of their tiers (or fail
        those whose wait ran out, drop those whose callers left)."""
        if not leases:
            return
        self._m.leases[reason].inc(len(leases))
        back = []
        tiers: set[int] = set()
        for x in leases:
            rec = self._submits.index.get(x.request_id)
            tiers.add(x.item.tier)
            if rec is None:
                continue
            if rec.future.done():
                self._submits.end(rec, "cancelled")
            elif rec.overdue:
                self._submits.end(rec, "deadline_exceeded", DeadlineExceeded(
                    "prefill: no engine acknowledged the request in time "
                    f"(tier {self._m.labels[rec.tier]}; its lease ended: {reason})"
                ))
            else:
                back.append(x)
        self._bal.requeue_front(requeue_order(back))
        for x in back:
            self._m.tenants.queued(x.item)
        self._log.info("prefill_leases_requeued", reason=reason, n=len(back),
                       engine_id=leases[0].engine_id)
        for t in tiers:
            self._m.gauge_tier(t)
            self._m.gauge_leases(t)
        self._wake_all()
