"""Requests an engine still holds from a daemon that is gone (failover or restart).

Prefill state is soft: a new leader (or a restarted daemon) starts with no leases. An engine
that accepted a request from the old daemon still runs it, and the request's submitter,
whose Submit was never answered, retries the same id on the new daemon. Without more, the
new daemon queues it and hands it to an engine a second time.

So an engine declares what it holds when it registers again (``PrefillEngineShape.held``),
and the new daemon *adopts* each such request:

* queued here (its submitter retried first): it leaves the queue and its Submit is answered
  with the holding engine and rank;
* leased here to another engine, not yet acknowledged: that lease ends (the other engine's
  acknowledgement is refused, so it never runs it) and the Submit is answered likewise;
* not known yet: its outcome is retained (``prefill.retention_ms``) so that the retry, when
  it comes, gets the holding engine at once.

A new leader also holds back its pulls for ``ha.adopt_grace_ms`` after it is elected, so
that the engines re-register (and declare) before anything queued is handed out.
Only the event loop touches this; times are ns of the daemon's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fulcrum.errors import InvalidArgument, ResourceExhausted
from fulcrum.metrics import prefill as m
from fulcrum.state.prefill.context import Part, Shell
from fulcrum.state.prefill.leasebook import LeaseBook
from fulcrum.state.prefill.records import Delivery
from fulcrum.state.prefill.submits import SubmitTable

#: How many held requests one registration may declare.
MAX_HELD = 16_384


@dataclass(frozen=True, slots=True)
class Held:
    """One request a registering engine holds: id, DP rank, context and cached tokens."""

    request_id: str
    dp_rank: int
    total: int
    cached: int


def validate_held(held: Sequence[Held], dp_ranks: int) -> None:
    """INVALID_ARGUMENT naming ``held`` for a declaration that breaks a rule (checked
    before the registration changes anything)."""
    if len(held) > MAX_HELD:
        raise InvalidArgument("prefill_engine.held", f"must have at most {MAX_HELD} entries")
    seen: set[str] = set()
    for i, h in enumerate(held):
        if not h.request_id or len(h.request_id) > 256:
            raise InvalidArgument(f"prefill_engine.held[{i}].request_id",
                                  "must be 1 to 256 characters")
        if h.request_id in seen:
            raise InvalidArgument(f"prefill_engine.held[{i}].request_id",
                                  f"{h.request_id!r} is declared twice")
        seen.add(h.request_id)
        if h.dp_rank >= dp_ranks:
            raise InvalidArgument(f"prefill_engine.held[{i}].dp_rank",
                                  f"must be < dp_ranks ({dp_ranks})")
        if h.total <= 0 or not 0 <= h.cached < h.total:
            raise InvalidArgument(f"prefill_engine.held[{i}]",
                                  "needs total_tokens > cached_tokens >= 0")


class Adopter(Part):
    """See the module docstring. Counts what it did in ``counts`` (``queued``,
    ``leased``, ``retained``, ``known``, ``full``)."""

    def __init__(self, shell: Shell, submits: SubmitTable, lease_book: LeaseBook) -> None:
        super().__init__(shell)
        self._submits = submits
        self._lease_book = lease_book
        self.counts = {"queued": 0, "leased": 0, "retained": 0, "known": 0, "full": 0}

    def adopt(self, engine_id: str, held: Sequence[Held]) -> int:
        """Adopt every request ``engine_id`` declares; returns how many were taken over
        (answered or retained). Lengths that differ from a request here leave it be."""
        n = 0
        for h in held:
            outcome = self._one(engine_id, h)
            self.counts[outcome] += 1
            n += outcome in ("queued", "leased", "retained")
        return n

    def _one(self, engine_id: str, h: Held) -> str:
        now = self._clock()
        rec = self._submits.index.get(h.request_id)
        if rec is not None:
            if (rec.item.total, rec.item.cached) != (h.total, h.cached):
                return "known"
            lease = self._leases.get(h.request_id)
            if lease is not None and lease.engine_id == engine_id:
                return "known"  # leased to this very engine: its acknowledgement decides
            how = "leased" if lease is not None else "queued"
            if lease is not None:
                self._leases.release(h.request_id)
                self._m.gauge_leases(rec.tier)
            elif self._bal.remove(h.request_id) is not None:
                self._m.tenants.left(h.request_id)
            self._submits.forget(rec)
            self._submits.resolve(rec, Delivery(
                engine_id, h.dp_rank, rec.item.tier, rec.item.cost_ns,
                max(0, now - rec.item.enqueued_ns)))
            self._m.gauge_tier(rec.tier)
            return how
        if self._submits.retained(h.request_id) is not None:
            return "known"
        s = self._settings()
        submitter = f"adopted:{engine_id}"
        try:
            self._submits.done.admit(submitter, now, s.max_retained,
                                     s.max_retained_per_submitter)
        except ResourceExhausted:
            return "full"
        tier = self._bal.tier_of(h.total)
        self._submits.done.put(
            h.request_id, h.total, h.cached,
            Delivery(engine_id, h.dp_rank, tier, 0, 0),
            now + s.retention_ms * 1_000_000, submitter)
        m.RETAINED.set(len(self._submits.done))
        return "retained"
