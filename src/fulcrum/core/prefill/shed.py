"""Shedding on a predicted deadline miss (issue 23): the intent, never the refusal itself.

A request of a sheddable class (:meth:`fulcrum.core.tenants.TenantTable.sheddable`)
with a TTFT deadline is refused at once when its predicted TTFT cannot meet it:

    predicted = (work ahead of it in its tier + its tier's engines' outstanding work)
                / DP ranks on its tier + its own cost        (ns)

*Work ahead* follows the order rule: under ``fifo`` everything queued in the tier;
otherwise every higher priority band, its own tenant's queued work in its band, and of
each other tenant of its band the share fair queueing serves first (``min(queued,
(own queued + own cost) * their weight / own weight)``; ``vtc_tokens`` has one band).
:func:`shed_check` returns a :class:`Shed` intent; the shell answers RESOURCE_EXHAUSTED
with ``retry-after-ms`` and never enqueues. With no engine on the tier there is no
prediction and nothing is shed. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fulcrum.core.prefill.items import Queued

if TYPE_CHECKING:
    from fulcrum.core.prefill.balancer import PrefillBalancer

#: Largest retry-after hint of a shed request, ms.
MAX_RETRY_AFTER_MS: Final = 60_000


@dataclass(frozen=True, slots=True)
class Shed:
    """Intent: refuse ``request_id`` (RESOURCE_EXHAUSTED). ``predicted_ns``: its
    predicted TTFT from now (ns); ``budget_ns``: what is left of its deadline (ns);
    ``retry_after_ms``: the hint (ms, >= 1)."""

    request_id: str
    predicted_ns: int
    budget_ns: int
    retry_after_ms: int


def work_ahead_ns(bal: PrefillBalancer, item: Queued) -> int:
    """Predicted cost (ns) queued in ``item``'s tier that is served before it."""
    q = bal.tier_queue(item.tier)
    rule = bal.config.rules.order.name
    if rule == "fifo":
        return bal.queued_ns(item.tier)
    bands = rule != "vtc_tokens"
    led, me, band = q.ledger, item.cls.tenant, item.cls.priority
    mine = sum(ns for (b, t), ns in q.flow_ns.items()
               if t == me and (b == band or not bands))
    reach = (mine + item.cost_ns) / led.weight(me)
    ahead = mine
    for (b, t), ns in q.flow_ns.items():
        if t == me:
            continue
        if bands and b > band:
            ahead += ns
        elif not bands or b == band:
            ahead += int(min(ns, reach * led.weight(t)))
    return ahead


def predicted_ttft_ns(bal: PrefillBalancer, item: Queued) -> int | None:
    """Predicted time (ns) until ``item`` would finish prefill if queued now; None when
    no engine serves its tier."""
    ranks = backlog = 0
    for e in bal.engine_ids():
        eng = bal.engine(e)
        if eng is not None and eng.tier == item.tier:
            ranks += eng.dp_ranks
            backlog += eng.load_ns
    if ranks == 0:
        return None
    return (work_ahead_ns(bal, item) + backlog) // ranks + item.cost_ns


def shed_check(bal: PrefillBalancer, item: Queued, sheddable: bool,
               elapsed_ns: int = 0) -> Shed | None:
    """The shed intent for ``item`` (``elapsed_ns``: time it already spent since
    submission, ns, e.g. in vision), or None to queue it: not sheddable, no deadline,
    no prediction, or the prediction meets the deadline."""
    slo = item.cls.ttft_slo_ns
    if not sheddable or slo is None:
        return None
    predicted = predicted_ttft_ns(bal, item)
    budget = slo - max(0, elapsed_ns)
    if predicted is None or predicted <= budget:
        return None
    retry = min(MAX_RETRY_AFTER_MS, max(1, -(-(predicted - budget) // 1_000_000)))
    return Shed(item.request_id, predicted, budget, retry)
