"""Metrics export of the prefill shell: the collectors of :mod:`fulcrum.metrics.prefill`,
their label children resolved once per tier (``labels()`` is slow on hot paths), set on
the event loop as the state changes."""

from __future__ import annotations

from collections.abc import Sequence

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill.balancer import PrefillBalancer, Redistribution, Taken
from fulcrum.core.prefill.bands import split_band
from fulcrum.core.prefill.leases import LeaseTable
from fulcrum.core.tenants import DEFAULT_TENANT
from fulcrum.metrics import prefill as m
from fulcrum.metrics.tenants import PrefillMeter
from fulcrum.state.prefill.records import LEASE_OUTCOMES, OUTCOMES, Batch
from fulcrum.units import NS_PER_S


class TierMetrics:
    """Label children of one tier."""

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


class PrefillMetrics:
    """Every prefill collector the shell sets, by tier (``labels``: the tier names); reads
    the balancer's queues and the lease table for its gauges."""

    def __init__(self, labels: Sequence[str], balancer: PrefillBalancer,
                 leases: LeaseTable) -> None:
        self._bal = balancer
        self._leases = leases
        self.labels = tuple(labels)
        self.tiers = [TierMetrics(label) for label in labels]
        # [request tier][engine tier] children
        self._helped = [[m.HELPED.labels(t, e) for e in labels] for t in labels]
        self._banded = [m.BANDED.labels(t) for t in labels]
        self._boosted = [m.PRECEDENCE.labels(t) for t in labels]
        self.leases = {o: m.LEASES.labels(o) for o in LEASE_OUTCOMES}
        #: Per-tenant figures (issue 23); the state gives it its tenant table's labels.
        self.tenants = PrefillMeter(lambda _tenant: DEFAULT_TENANT)
        for tm in self.tiers:
            tm.engines.set(0)

    def count(self, tier: int, outcome: str, n: int = 1) -> None:
        """``n`` submits of ``tier`` ended with ``outcome`` (one of :data:`OUTCOMES`)."""
        self.tiers[tier].outcomes[outcome].inc(n)

    def gauge_tier(self, tier: int) -> None:
        """Queue depth (requests) and queued quota (s) of ``tier`` now."""
        tm = self.tiers[tier]
        tm.depth.set(self._bal.queue_depth(tier))
        tm.quota.set(self._bal.queued_ns(tier) / NS_PER_S)

    def gauge_leases(self, tier: int) -> None:
        """Leased requests (all tiers) and ``tier``'s leased quota (s) now."""
        m.LEASED.set(len(self._leases))
        self.tiers[tier].leased_quota.set(self._leases.leased_ns[tier] / NS_PER_S)

    def gauge_model(self, model: CostModel) -> None:
        """The cost model's coefficients in force."""
        m.COST_COEFFICIENT.labels("a").set(model.a)
        m.COST_COEFFICIENT.labels("b").set(model.b)
        m.COST_COEFFICIENT.labels("k").set(model.k)

    def imbalance(self, tier: int, loads: Sequence[int]) -> None:
        """Observe max/mean of the rank loads a pull reports (not for idle engines, nor
        for an engine with no tier), in the tier the engine serves."""
        if len(loads) < 2 or not any(loads) or tier < 0:
            return
        self.tiers[tier].imbalance.observe(max(loads) * len(loads) / sum(loads))

    def pulled(self, batch: Batch) -> Batch:
        """Count a pull's reply (a batch or empty) in its tier; returns ``batch``."""
        if batch.tier < 0:
            return batch
        tm = self.tiers[batch.tier]
        if batch.items:
            tm.pulls_batch.inc()
            tm.batch_requests.observe(len(batch.items))
            tm.batch_quota.observe(batch.quota_ns / NS_PER_S)
        else:
            tm.pulls_empty.inc()
        return batch

    def helped(self, taken: Taken, own: int) -> None:
        """An engine of tier ``own`` took ``taken``: counted when of another tier, the
        requests a band pass took (by the work ahead of their band) and those taken with
        fair-share precedence."""
        tier = taken.tier
        if 0 <= own != tier:
            self._helped[tier][own].inc(len(taken.items))
        if taken.banded > 0:
            self._banded[tier].inc(taken.banded)
        boosted = sum(split_band(b)[1] for b in taken.bands)
        if boosted:
            self._boosted[tier].inc(boosted)

    def redistributed(self, red: Redistribution) -> None:
        """Rounds, moves, engines per tier and (closing a round) each tier's demand (s)."""
        m.ROUNDS.labels(red.reason).inc()
        if red.moves:
            m.MOVES.inc(red.moves)
        for t, tm in enumerate(self.tiers):
            tm.engines.set(red.counts[t])
            if red.reason == "round":
                tm.demand.set(red.demand_ns[t] / NS_PER_S)
