"""Leases of pulled prefill batches: acknowledged delivery, pure bookkeeping.

A batch an engine pulls is *leased* to it until a deadline (ns). The engine acknowledges
the requests it accepted; an acknowledged request is done (its submitter learns this
engine and rank, exactly once). A lease that expires, or whose engine leaves, hands its
unacknowledged requests back to the caller, which puts them at the head of their tier
(:meth:`fulcrum.core.prefill.balancer.PrefillBalancer.requeue_front`) so another engine
gets them. An acknowledgement of a request no longer leased to that engine is refused
(the engine must not run it).

Nothing here reads a clock: ``now_ns`` is passed in. Every request is in at most one
lease at a time; :class:`LeaseTable` keeps the leased quota per tier (ns) exactly, so
shells can count leased work in a tier's demand or gauges.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fulcrum.core.prefill.balancer import Queued


@dataclass(slots=True, eq=False)
class Lease:
    """One leased request: the queued item, the engine holding it, its DP rank and the
    lease deadline (ns)."""

    item: Queued
    engine_id: str
    dp_rank: int
    deadline_ns: int

    @property
    def request_id(self) -> str:
        return self.item.request_id


@dataclass(frozen=True, slots=True)
class AckResult:
    """Result of :meth:`LeaseTable.ack`: the leases acknowledged (done, removed) and the
    ids refused (not leased to that engine: expired and reassigned, or unknown)."""

    accepted: tuple[Lease, ...] = ()
    rejected: tuple[str, ...] = ()


@dataclass(slots=True)
class LeaseTable:
    """Leased requests by id, with leased quota per tier (ns). One owner, not thread-safe."""

    n_tiers: int
    _by_id: dict[str, Lease] = field(default_factory=dict)
    _by_engine: dict[str, dict[str, Lease]] = field(default_factory=dict)
    leased_ns: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.leased_ns:
            self.leased_ns = [0] * self.n_tiers

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> Lease | None:
        """The lease of ``request_id``, or None."""
        return self._by_id.get(request_id)

    def held_by(self, engine_id: str) -> list[Lease]:
        """Leases an engine holds (lease order)."""
        return list(self._by_engine.get(engine_id, {}).values())

    def lease(
        self,
        engine_id: str,
        items: Sequence[Queued],
        ranks: Sequence[int],
        deadline_ns: int,
    ) -> list[Lease]:
        """Lease a taken batch (``items[i]`` on DP rank ``ranks[i]``) to ``engine_id``
        until ``deadline_ns``. ValueError when a request is already leased."""
        if len(items) != len(ranks):
            raise ValueError("ranks: need one rank per item")
        for it in items:
            if it.request_id in self._by_id:
                raise ValueError(f"request_id: {it.request_id!r} is already leased")
        own = self._by_engine.setdefault(engine_id, {})
        out = []
        for it, r in zip(items, ranks, strict=True):
            lease = Lease(it, engine_id, int(r), deadline_ns)
            self._by_id[it.request_id] = lease
            own[it.request_id] = lease
            self.leased_ns[it.tier] += it.cost_ns
            out.append(lease)
        return out

    def _pop(self, lease: Lease) -> None:
        del self._by_id[lease.request_id]
        own = self._by_engine[lease.engine_id]
        del own[lease.request_id]
        if not own:
            del self._by_engine[lease.engine_id]
        self.leased_ns[lease.item.tier] -= lease.item.cost_ns

    def ack(self, engine_id: str, request_ids: Iterable[str], now_ns: int) -> AckResult:
        """``engine_id`` accepted ``request_ids``. Those leased to it with a deadline not
        yet passed (``now_ns < deadline_ns``) are acknowledged and removed; the others are
        refused (an expired lease is NOT acknowledged: the request is the caller's to
        requeue, see :meth:`expired`). Duplicate ids count once."""
        accepted: list[Lease] = []
        rejected: list[str] = []
        seen: set[str] = set()
        for rid in request_ids:
            if rid in seen:
                continue
            seen.add(rid)
            lease = self._by_id.get(rid)
            if lease is None or lease.engine_id != engine_id or now_ns >= lease.deadline_ns:
                rejected.append(rid)
                continue
            self._pop(lease)
            accepted.append(lease)
        return AckResult(tuple(accepted), tuple(rejected))

    def release(self, request_id: str) -> Lease | None:
        """Remove one lease (submitter gone, drain); None when not leased."""
        lease = self._by_id.get(request_id)
        if lease is not None:
            self._pop(lease)
        return lease

    def expired(self, now_ns: int) -> list[Lease]:
        """Remove and return every lease whose deadline is at or before ``now_ns``
        (lease order), for the caller to requeue."""
        out = [lease for lease in self._by_id.values() if lease.deadline_ns <= now_ns]
        for lease in out:
            self._pop(lease)
        return out

    def drop_engine(self, engine_id: str) -> list[Lease]:
        """Remove and return every lease ``engine_id`` holds (it lapsed or left)."""
        out = self.held_by(engine_id)
        for lease in out:
            self._pop(lease)
        return out


def requeue_order(leases: Sequence[Lease]) -> list[Queued]:
    """The items of returned leases in the order to put back at the head of their tiers:
    by original arrival (``enqueued_ns``, then id), so the oldest is served first."""
    return sorted((x.item for x in leases), key=lambda it: (it.enqueued_ns, it.request_id))
