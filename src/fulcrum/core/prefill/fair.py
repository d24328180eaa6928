"""Tier queues with tenants and priority bands, and the fair-share ledger (issue 23).

A :class:`TierQueue` holds one tier's queued requests three ways at once: in arrival
order (a taken request put back goes to the front: today's FIFO queue), per priority
band in the same order, and per band per tenant (a *flow*) in the same order. The
queue *order rule* (:mod:`fulcrum.core.prefill.rules.order`) walks them in take order.

The :class:`FairLedger` is shared by every tier queue of a balancer (a tenant's share is
of the whole fleet's prefill compute): per tenant a virtual time (charged units / weight;
units: ns of predicted cost, or tokens for ``vtc_tokens``), the system virtual time
``vnow`` (start-time fair queueing: the virtual time of the flow served last), the
tenant's queued count over all tiers (a flow that becomes backlogged is lifted to
``vnow``, as in VTC: an idle tenant banks no credit, its share is lent), and an
exponentially decayed sum of each tenant's served ns (time constant ``cap_window_ns``:
its compute cap, and whether it is under its fair share, :meth:`TierQueue.leads`).
Idle tenants' entries are dropped: a virtual time once it carries no debt, served ns
three windows after the last service. So the ledger holds the tenants with queued work,
debt or recent service (bounded by the tenant table).
Pure: every time is passed in (ns).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator

from fulcrum.core.prefill.items import Queued
from fulcrum.core.tenants import TenantPolicy

Flow = OrderedDict[str, Queued]


class FairLedger:
    """Virtual times, queued counts and capped usage per tenant (see module docstring).

    ``ranks``: the prefill DP ranks in the fleet, kept by the balancer as engines join
    and leave (a compute cap, and a fair share, is a fraction of ``ranks x
    cap_window_ns`` ns per window; read on every precedence check, so never summed)."""

    def __init__(self, policy: TenantPolicy) -> None:
        self.policy = policy
        self.ranks = 0
        self.v: dict[str, float] = {}
        self.vnow = 0.0
        self.count: dict[str, int] = {}
        self.used: dict[str, tuple[float, int]] = {}
        #: Latest time the shell gave (ns): the clock of starvation checks without one.
        self.now_ns = 0
        #: The tier queues sharing this ledger (told when a tenant's virtual time moves).
        self.queues: list[TierQueue] = []
        #: Ledger size past which the next charge sweeps (see :meth:`_sweep`).
        self.sweep_at = min(self.SWEEP_AT, policy.max_tenants)
        #: Served-ns entries past which the next charge forgets (:meth:`_forget_used`).
        self.forget_at = self.sweep_at

    def set_policy(self, policy: TenantPolicy) -> None:
        """Adopt a new tenant policy (reload): the queues' summed weights afresh."""
        self.policy = policy
        for q in self.queues:
            q.reweigh()

    def weight(self, tenant: str) -> float:
        """Fair-share weight of ``tenant``."""
        return self.policy.classes.get(tenant, self.policy.default).weight

    def cap(self, tenant: str) -> float | None:
        """Compute cap of ``tenant`` (fraction of the fleet), None: none."""
        return self.policy.classes.get(tenant, self.policy.default).compute_cap

    def vt(self, tenant: str) -> float:
        """Virtual time of ``tenant`` (units per weight)."""
        return self.v.get(tenant, self.vnow)

    def joined(self, tenant: str) -> None:
        """One more request of ``tenant`` is queued (a new backlog is lifted to vnow)."""
        n = self.count.get(tenant, 0)
        if n == 0:
            self.v[tenant] = max(self.v.get(tenant, self.vnow), self.vnow)
        self.count[tenant] = n + 1

    def left(self, tenant: str) -> None:
        """One request of ``tenant`` left the queues (taken, cancelled, expired)."""
        n = self.count.get(tenant, 0) - 1
        if n > 0:
            self.count[tenant] = n
            return
        self.count.pop(tenant, None)
        if self.v.get(tenant, 0.0) <= self.vnow:
            self.v.pop(tenant, None)  # no debt: a new backlog starts at vnow anyway

    def charge(self, tenant: str, units: float, cost_ns: int, now_ns: int | None) -> None:
        """``tenant`` was served ``units`` (its order rule's) costing ``cost_ns``."""
        v = self.vt(tenant)
        self.vnow = max(self.vnow, v)
        self.v[tenant] = v + units / self.weight(tenant)
        self._moved(tenant)
        if len(self.v) > max(self.sweep_at, 2 * len(self.count)):
            self._sweep()
        t = self.now_ns if now_ns is None else now_ns
        self.used[tenant] = (self.usage(tenant, t) + cost_ns, t)
        if len(self.used) > max(self.forget_at, 2 * len(self.count)):
            self._forget_used(t)

    #: Ledger size that starts a sweep of idle tenants' entries.
    SWEEP_AT = 1024

    def _sweep(self) -> None:
        """Drop idle tenants' virtual times at or below ``vnow`` (a new backlog starts
        there anyway); past ``max_tenants`` entries, also the idle ones with the least
        debt, down to nine tenths of ``max_tenants``.

        Amortised O(1) per charge: the next sweep waits until the ledger has doubled
        (from at least ``SWEEP_AT``, at most to ``max_tenants``), so a sweep that finds
        every idle tenant in debt is not repeated on the next charge (it was, on every
        charge: O(tenants) each, 1.5 ms per request at 10,000 tenants)."""
        idle = [t for t in self.v if t not in self.count]
        for t in idle:
            if self.v[t] <= self.vnow:
                del self.v[t]
        limit = self.policy.max_tenants
        over = len(self.v) - limit
        if over > 0:
            over += max(1, limit // 10)
            rest = (t for t in idle if t in self.v)
            for t in heapq.nsmallest(over, rest, key=self.v.__getitem__):
                del self.v[t]
        self.sweep_at = min(limit, max(self.SWEEP_AT, 2 * len(self.v)))

    def _forget_used(self, now_ns: int) -> None:
        """Drop the served ns of idle tenants served last over three windows ago (decayed
        below ``exp(-3)``); past ``max_tenants`` entries, the idle ones served longest
        ago. Amortised O(1) per charge, as :meth:`_sweep` (the next run waits until the
        entries have doubled)."""
        old = now_ns - 3 * self.policy.cap_window_ns
        idle = [t for t in self.used if t not in self.count]
        for t in idle:
            if self.used[t][1] <= old:
                del self.used[t]
        over = len(self.used) - self.policy.max_tenants
        if over > 0:
            rest = (t for t in idle if t in self.used)
            for t in heapq.nsmallest(over, rest, key=lambda x: self.used[x][1]):
                del self.used[t]
        self.forget_at = min(self.policy.max_tenants, max(self.SWEEP_AT, 2 * len(self.used)))

    def fair_ns(self, share: float) -> float:
        """Served ns over the window (:meth:`usage`'s scale) of a tenant getting
        ``share`` of the fleet (``ranks`` x ``cap_window_ns``): a fair share's, or a
        compute cap's budget."""
        return share * max(1, self.ranks) * self.policy.cap_window_ns

    def refund(self, tenant: str, units: float) -> None:
        """A taken request of ``tenant`` came back unserved (a lapsed lease)."""
        if tenant in self.v:
            self.v[tenant] = max(self.vnow, self.v[tenant] - units / self.weight(tenant))
            self._moved(tenant)

    def _moved(self, tenant: str) -> None:
        for q in self.queues:
            q.repush(tenant)

    def reset(self) -> None:
        """Forget every virtual time (another order rule counts other units): queued
        tenants restart at ``vnow``."""
        self.v = {t: self.vnow for t in self.count}
        for q in self.queues:
            q.rebuild()

    def usage(self, tenant: str, now_ns: int) -> float:
        """Served ns of ``tenant``, exponentially decayed over ``cap_window_ns``."""
        val, at = self.used.get(tenant, (0.0, now_ns))
        return val * math.exp(-max(0, now_ns - at) / self.policy.cap_window_ns)

    def capped(self, tenant: str, now_ns: int) -> bool:
        """True when ``tenant`` has used its compute cap of the fleet (skip its work)."""
        cap = self.cap(tenant)
        if cap is None:
            return False
        return self.usage(tenant, now_ns) >= self.fair_ns(cap)

    @property
    def any_cap(self) -> bool:
        """True when some tenant class has a compute cap."""
        p = self.policy
        return p.default.compute_cap is not None or any(
            s.compute_cap is not None for s in p.classes.values())


class TierQueue:
    """One tier's queue: arrival order, per band, per band and tenant (module docstring).

    ``seq`` numbers each request's place in arrival order (a put-back request gets a
    number below every other); ``served_ns`` is when each band was last served (the
    starvation bound counts from it)."""

    def __init__(self, ledger: FairLedger) -> None:
        self.ledger = ledger
        self.all: Flow = OrderedDict()
        self.bands: dict[int, Flow] = {}
        self.flows: dict[int, OrderedDict[str, Flow]] = {}
        self.seq: dict[str, int] = {}
        self.served_ns: dict[int, int] = {}
        #: Queued predicted cost per (band, tenant), ns.
        self.flow_ns: dict[tuple[int, str], int] = {}
        #: Summed fair-share weight of each band's flows.
        self.weights: dict[int, float] = {}
        #: Per band, a heap of (virtual time, head seq, tenant) of its flows; an entry is
        #: stale once the flow's head or the tenant's virtual time moved (dropped lazily).
        self.heaps: dict[int, list[tuple[float, int, str]]] = {}
        self._tail = 0
        self._front = 0
        ledger.queues.append(self)

    def __len__(self) -> int:
        return len(self.all)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.all

    def single(self) -> bool:
        """True when every request is of one tenant and band (then all orders are FIFO)."""
        if len(self.bands) > 1:
            return False
        return all(len(f) <= 1 for f in self.flows.values())

    def _place(self, item: Queued, front: bool) -> None:
        rid, band, tenant = item.request_id, item.cls.priority, item.cls.tenant
        bq = self.bands.setdefault(band, OrderedDict())
        flows = self.flows.setdefault(band, OrderedDict())
        if tenant not in flows:
            self.weights[band] = self.weights.get(band, 0.0) + self.ledger.weight(tenant)
        flow = flows.setdefault(tenant, OrderedDict())
        for q in (self.all, bq, flow):
            q[rid] = item
            if front:
                q.move_to_end(rid, last=False)
        if front:
            self._front -= 1
            self.seq[rid] = self._front
        else:
            self._tail += 1
            self.seq[rid] = self._tail
        key = (band, tenant)
        self.flow_ns[key] = self.flow_ns.get(key, 0) + item.cost_ns
        self.ledger.joined(tenant)
        if next(iter(flow)) == rid:
            self._push(band, tenant)  # a new head of its flow

    def add(self, item: Queued) -> None:
        """Queue ``item`` at the tail."""
        self._place(item, front=False)

    def add_front(self, item: Queued) -> None:
        """Put ``item`` back at the front (of its band and flow too)."""
        self._place(item, front=True)

    def discard(self, item: Queued) -> None:
        """Take ``item`` out (it must be queued here)."""
        rid, band, tenant = item.request_id, item.cls.priority, item.cls.tenant
        del self.all[rid]
        del self.seq[rid]
        bq = self.bands[band]
        del bq[rid]
        flows = self.flows[band]
        flow = flows[tenant]
        was_head = next(iter(flow)) == rid
        del flow[rid]
        self.flow_ns[band, tenant] -= item.cost_ns
        if not flow:
            del flows[tenant]
            del self.flow_ns[band, tenant]
            self.weights[band] -= self.ledger.weight(tenant)
        if not bq:
            del self.bands[band]
            del self.flows[band]
            del self.weights[band]
            self.heaps.pop(band, None)
        self.ledger.left(tenant)
        if flow and was_head:
            self._push(band, tenant)

    # -- the per-band heaps of flows ------------------------------------------------------

    def _push(self, band: int, tenant: str) -> None:
        flow = self.flows[band][tenant]
        h = self.heaps.setdefault(band, [])
        heapq.heappush(h, (self.ledger.vt(tenant), self.seq[next(iter(flow))], tenant))
        if len(h) > 2 * len(self.flows[band]) + 16:
            self._rebuild_band(band)

    def valid(self, band: int, entry: tuple[float, int, str]) -> bool:
        """True when ``entry`` is the current (virtual time, head seq) of its flow."""
        v, seq, tenant = entry
        flows = self.flows.get(band)
        flow = None if flows is None else flows.get(tenant)
        return (flow is not None and self.seq[next(iter(flow))] == seq
                and self.ledger.vt(tenant) == v)

    def repush(self, tenant: str) -> None:
        """``tenant``'s virtual time moved: fresh heap entries for its flows."""
        for band, flows in self.flows.items():
            if tenant in flows:
                self._push(band, tenant)

    def _rebuild_band(self, band: int) -> None:
        led, flows = self.ledger, self.flows[band]
        h = [(led.vt(t), self.seq[next(iter(f))], t) for t, f in flows.items()]
        heapq.heapify(h)
        self.heaps[band] = h

    def reweigh(self) -> None:
        """Every band's summed weight afresh (the tenant policy changed)."""
        w = self.ledger.weight
        self.weights = {b: sum(w(t) for t in flows) for b, flows in self.flows.items()}

    def rebuild(self) -> None:
        """Every band's heap afresh."""
        for band in self.flows:
            self._rebuild_band(band)

    def heap(self, band: int) -> list[tuple[float, int, str]]:
        """``band``'s heap with its top valid (stale top entries dropped): ``[0]`` is the
        flow fair queueing serves next. O(log flows) amortised."""
        h = self.heaps[band]
        while h and not self.valid(band, h[0]):
            heapq.heappop(h)
        if not h:
            self._rebuild_band(band)
            h = self.heaps[band]
        return h

    def leads(self, item: Queued) -> bool:
        """True when ``item``'s tenant is under its fair share while another tenant's work
        waits in its band (fair-share precedence on the ranks,
        :data:`fulcrum.core.prefill.bands.PRECEDENCE`): its served ns over the window
        (:meth:`FairLedger.usage`) below its weight's part, among the tenants with work in
        the band, of the fleet's compute. O(1)."""
        band, tenant = item.cls.priority, item.cls.tenant
        flows = self.flows.get(band)
        if flows is None or len(flows) < 2 or tenant not in flows:
            return False
        led = self.ledger
        share = led.weight(tenant) / self.weights[band]
        return led.usage(tenant, led.now_ns) < led.fair_ns(share)

    def served(self, item: Queued, now_ns: int | None) -> None:
        """``item`` was taken at ``now_ns``: its band was served, its flow goes last in
        its band's round-robin turn."""
        band = item.cls.priority
        self.served_ns[band] = self.ledger.now_ns if now_ns is None else now_ns
        flows = self.flows.get(band)
        if flows is not None and item.cls.tenant in flows:
            flows.move_to_end(item.cls.tenant)

    def starved_since(self, band: int) -> int:
        """When ``band``'s wait for service began (ns): the later of its last service
        and its oldest request's enqueue time (the band must be non-empty)."""
        oldest = next(iter(self.bands[band].values())).enqueued_ns
        return max(self.served_ns.get(band, oldest), oldest)

    def fifo(self, now_ns: int) -> Iterator[Queued]:
        """Arrival order, skipping tenants at their compute cap."""
        led = self.ledger
        if not led.any_cap:
            yield from self.all.values()
            return
        for item in self.all.values():
            if not led.capped(item.cls.tenant, now_ns):
                yield item
