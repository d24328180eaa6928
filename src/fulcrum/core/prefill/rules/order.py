"""Order rules: the take order inside a tier queue (issue 23).

* ``wfq_ns`` (default): priority bands, highest first; within a band, weighted fair
  queueing over predicted compute: the flow (tenant) with the least virtual time
  (charged ns of ``cost(q, c)`` / weight; VTC's counters, in ns) goes next, ties by
  arrival; FIFO within a tenant. Work-conserving: an idle tenant's share is lent (its
  counter is lifted to the system's when it comes back, so it banks no credit). A lower
  band whose wait for service (since it was last served, or since its oldest request
  came) reached ``tenants.starvation_bound_ms`` has its oldest request taken first.
  With one tenant at one priority it is exactly FIFO.
* ``fifo``: arrival order, tenants and priorities ignored (the order before issue 23).
* ``strict_rr``: strict priority bands (no starvation bound); round robin between the
  fairness ids of a band, one request each, FIFO within one (llm-d's flow control).
* ``vtc_tokens``: no bands; the tenant with the least virtual token counter (computed
  prompt tokens / weight) goes next (AIBrix's VTC, prefill side).

Every rule skips tenants at their compute cap (:meth:`FairLedger.capped`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

from fulcrum.core.prefill.fair import FairLedger, Flow, TierQueue
from fulcrum.core.prefill.items import Queued
from fulcrum.core.prefill.rules.base import RULES, OrderRule
from fulcrum.core.registry import NoParams


def fair_flows(queue: TierQueue, flows: Iterable[tuple[str, Flow]], now_ns: int,
               units: Callable[[Queued], float]) -> Iterator[Queued]:
    """Weighted fair order over ``flows`` (tenant, FIFO of its requests): the least
    virtual time next (ties: arrival), charging ``units(item)`` / weight provisionally
    as each request is yielded. O(log flows) per request."""
    led = queue.ledger
    heap: list[tuple[float, int, str, Queued, Iterator[Queued]]] = []
    for tenant, flow in flows:
        if led.capped(tenant, now_ns):
            continue
        it = iter(flow.values())
        first = next(it)
        heap.append((led.vt(tenant), queue.seq[first.request_id], tenant, first, it))
    heapq.heapify(heap)
    while heap:
        v, _, tenant, item, it = heapq.heappop(heap)
        yield item
        nxt = next(it, None)
        if nxt is not None:
            v += units(item) / led.weight(tenant)
            heapq.heappush(heap, (v, queue.seq[nxt.request_id], tenant, nxt, it))


def band_flows(queue: TierQueue, band: int, now_ns: int) -> Iterator[Queued]:
    """Weighted fair order within ``band`` from the queue's persistent heap of flows
    (:meth:`TierQueue.heap`): a copy is walked, each yielded request charging its cost
    (ns) / weight to its tenant provisionally. The head costs O(log flows)."""
    led, flows = queue.ledger, queue.flows[band]
    work = list(queue.heap(band))
    prov: dict[str, tuple[float, int] | None] = {}
    nexts: dict[str, tuple[Queued, Iterator[Queued]]] = {}
    while work:
        v, seq, tenant = heapq.heappop(work)
        if tenant in prov:
            if prov[tenant] != (v, seq):
                continue
            item, it = nexts[tenant]
        elif queue.valid(band, (v, seq, tenant)):
            if led.any_cap and led.capped(tenant, now_ns):
                prov[tenant] = None
                continue
            it = iter(flows[tenant].values())
            item = next(it)
        else:
            continue
        yield item
        nxt = next(it, None)
        if nxt is None:
            prov[tenant] = None
            continue
        v += item.cost_ns / led.weight(tenant)
        prov[tenant] = (v, queue.seq[nxt.request_id])
        nexts[tenant] = (nxt, it)
        heapq.heappush(work, (v, queue.seq[nxt.request_id], tenant))


def plain(queue: TierQueue) -> Iterator[Queued] | None:
    """Arrival order when ``queue`` holds one tenant at one priority and no compute cap
    applies (every rule is exactly FIFO then); None otherwise."""
    if queue.single() and not queue.ledger.any_cap:
        return iter(queue.all.values())
    return None


def _starved(queue: TierQueue, bands: list[int], now_ns: int) -> list[Queued]:
    """The oldest request of each lower band starved past the bound (oldest first)."""
    led: FairLedger = queue.ledger
    bound = led.policy.starvation_bound_ns
    out: list[tuple[int, int, Queued]] = []
    for b in bands[1:]:
        since = queue.starved_since(b)
        if now_ns - since < bound:
            continue
        first = next((it for it in queue.bands[b].values()
                      if not led.capped(it.cls.tenant, now_ns)), None)
        if first is not None:
            out.append((since, queue.seq[first.request_id], first))
    return [x[2] for x in sorted(out, key=lambda x: (x[0], x[1]))]


@dataclass(frozen=True, slots=True)
class WfqNs(OrderRule):
    """Priority bands with a starvation bound, then weighted fair shares in ns."""

    name: ClassVar[str] = "wfq_ns"
    precedence: ClassVar[bool] = True

    def order(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        return plain(queue) or self._fair(queue, now_ns)

    def _fair(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        bands = sorted(queue.bands, reverse=True)
        first = _starved(queue, bands, now_ns)
        yield from first
        done = {it.request_id for it in first}
        for b in bands:
            for item in band_flows(queue, b, now_ns):
                if item.request_id not in done:
                    yield item


def _round_robin(queue: TierQueue, flows: Iterable[tuple[str, Flow]],
                 now_ns: int) -> Iterator[Queued]:
    led = queue.ledger
    turns = []
    for t, f in flows:  # the first turn lazily: the head costs O(1)
        if led.any_cap and led.capped(t, now_ns):
            continue
        it = iter(f.values())
        yield next(it)
        turns.append(it)
    while turns:
        alive = []
        for it in turns:
            item = next(it, None)
            if item is not None:
                yield item
                alive.append(it)
        turns = alive


@dataclass(frozen=True, slots=True)
class StrictRoundRobin(OrderRule):
    """Strict priority bands; round robin between a band's fairness ids."""

    name: ClassVar[str] = "strict_rr"

    def order(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        return plain(queue) or self._bands(queue, now_ns)

    def _bands(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        for b in sorted(queue.bands, reverse=True):
            yield from _round_robin(queue, queue.flows[b].items(), now_ns)


def computed_tokens(item: Queued) -> float:
    """Prompt tokens a request computes (its total minus its cached prefix), tokens."""
    return float(max(1, item.total - item.cached))


@dataclass(frozen=True, slots=True)
class VtcTokens(OrderRule):
    """Virtual token counters (VTC), no priority bands."""

    name: ClassVar[str] = "vtc_tokens"

    def order(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        flows = [x for b in queue.flows.values() for x in b.items()]
        return plain(queue) or fair_flows(queue, flows, now_ns, computed_tokens)

    def units(self, item: Queued, cost_ns: int) -> float:
        return computed_tokens(item)


@dataclass(frozen=True, slots=True)
class Fifo(OrderRule):
    """Arrival order (tenants and priorities ignored)."""

    name: ClassVar[str] = "fifo"

    def order(self, queue: TierQueue, now_ns: int) -> Iterator[Queued]:
        return queue.fifo(now_ns)


RULES.register(WfqNs.name, lambda p: WfqNs(), NoParams, kind=WfqNs.kind)
RULES.register(Fifo.name, lambda p: Fifo(), NoParams, kind=Fifo.kind)
RULES.register(StrictRoundRobin.name, lambda p: StrictRoundRobin(), NoParams,
               kind=StrictRoundRobin.kind)
RULES.register(VtcTokens.name, lambda p: VtcTokens(), NoParams, kind=VtcTokens.kind)
