"""Priority bands on an engine's DP ranks (issue 23): who runs first on a rank, and how
much work is ahead of a request of a given band.

Without bands a rank's queue is FIFO and a pulled request of priority 1 waits behind the
priority-0 work its rank already holds (whole prompts of up to the tier's batch cap).
Its wait for an engine was worse: late binding lets an engine take work only while its
least-loaded rank holds less than the horizon, and under a priority-0 flood every rank
holds more, so a priority-1 request waited in the daemon's queue until some rank drained.

The rule (pure; the engine kit, the daemon and the simulator share it):

* **On the rank** (:func:`fulcrum.core.prefill.chunks.enqueue_task`): a task goes behind
  the last task of its band or a higher one, ahead of lower-band tasks (a lower-band
  task split mid-prompt pauses at its chunk boundary; its computed prefix stays).
  Within a band: FIFO. A lower-band task lets at most ``max_overtaken_tokens`` tokens of
  later higher-band work pass it
  (:data:`fulcrum.core.prefill.chunks.DEFAULT_MAX_OVERTAKEN_TOKENS`); past that it keeps
  its place, so no task on a rank waits forever (the engine-side counterpart of
  ``tenants.starvation_bound_ms``).
* **Work ahead** (:func:`fulcrum.core.prefill.chunks.band_loads`): for each band ``p``
  an engine holds, per rank, the predicted cost (ns) of its tasks of priority ``p`` or
  higher. The engine sends them with its pull (``PullRequest.band_rank_loads``); the
  balancer binds and places a request of band ``p`` by these loads (:func:`loads_for`)
  instead of the rank's whole load, since that is what runs before it.

**Fair-share precedence** (the default order rule, ``wfq_ns``): a request taken while
its tenant is under its fair share of the fleet's compute, with another tenant's work
waiting in its band (:meth:`fulcrum.core.prefill.fair.TierQueue.leads`), gets the rank
band ``priority + PRECEDENCE`` instead of ``priority``: on its rank it goes ahead of its
band's other work (within the overtaking bound), below every higher band, and the
balancer binds and places it by that half band's work ahead (the band pass looks past
up to the pull's request cap of its own priority's other requests to find it). So a
tenant under its share is served first on the ranks too, not only in the daemon's
queue: without it a light tenant's short request, first in the queue, still waited on
its rank behind the heavy tenant's work taken before it (up to the late-binding
horizon). The wire carries it as
``priority`` plus a ``boosted`` flag (:func:`rank_band`, :func:`split_band`).

With one band everywhere nothing changes: FIFO queues, whole loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from fulcrum.core.prefill.items import Offer, Taken

PRECEDENCE: float = 0.5
"""How far fair-share precedence lifts a request's rank band: half a band, so it passes
its own band's other work and no higher band's."""


def rank_band(priority: int, boosted: bool) -> float:
    """The band a request runs in on its rank: its priority, half a band up when it was
    taken with fair-share precedence."""
    return priority + PRECEDENCE if boosted else float(priority)


def split_band(band: float) -> tuple[int, bool]:
    """(priority, boosted) of a rank band (:func:`rank_band`'s inverse, for the wire)."""
    p = math.floor(band)
    return p, band != p


def loads_for(priority: float, rank_loads_ns: Sequence[int],
              bands: Mapping[float, Sequence[int]] | None) -> Sequence[int]:
    """The rank loads (ns) that run before a request of ``priority``: those of the lowest
    reported band at or above it (zero when the engine holds nothing of its band or
    higher); the whole ``rank_loads_ns`` when the engine reports no bands."""
    if not bands:
        return rank_loads_ns
    above = [p for p in bands if p >= priority]
    if not above:
        return [0] * len(rank_loads_ns)
    return bands[min(above)]


def _freed(whole: Sequence[int], ahead: Sequence[int]) -> int:
    return sum(max(0, int(a) - int(b)) for a, b in zip(whole, ahead, strict=True))


def offer_for(offer: Offer, priority: float) -> tuple[Sequence[int], int]:
    """An offer's rank loads and remaining quota (ns) as a request of ``priority`` sees
    them: the work ahead of its band, and the quota that work leaves free."""
    whole = offer.rank_loads_ns
    ahead = loads_for(priority, whole, offer.band_loads)
    if ahead is whole or len(ahead) != len(whole):
        return whole, offer.remaining_ns
    return ahead, offer.remaining_ns + _freed(whole, ahead)


def band_pass(band: float | None, loads: Sequence[int],
              bands: Mapping[float, Sequence[int]] | None, remaining_ns: int,
              run: Callable[[list[int], int, float], Taken]) -> Taken | None:
    """The band pass of :meth:`PrefillBalancer.take`: when ``band`` (the highest band
    queued in the tier) has less work ahead on the engine (``bands``) than the whole rank
    ``loads`` (ns), ``run(ahead, remaining, band)`` takes the requests of that band or
    higher by that work, in take order up to the first of a lower band (a lower band
    owed service past the starvation bound comes first and so ends the pass at once),
    the quota it leaves free added to ``remaining_ns``; None when there is nothing to do
    so (or nothing was taken)."""
    if not bands or band is None:
        return None
    ahead = [max(0, int(x)) for x in loads_for(band, loads, bands)]
    if len(ahead) != len(loads) or sum(ahead) >= sum(loads):
        return None
    taken = run(ahead, remaining_ns + _freed(loads, ahead), band)
    return taken if taken.items or taken.dead else None


def after_pass(first: Taken | None, loads: Sequence[int], remaining_ns: int,
               limit: int | None, most_requests: int,
               cap_ns: int) -> tuple[list[int], int, int | None]:
    """Rank loads (ns), remaining quota (ns) and request limit left for the usual pass
    after the band pass ``first`` (unchanged when there was none): the two passes
    together stay within the pull's request limit (``limit``, else ``most_requests``)
    and the tier's batch cap (``cap_ns``). A limit of 0: nothing more to take."""
    after = list(loads)
    if first is None:
        return after, remaining_ns, limit
    for r, c in zip(first.ranks, first.costs_ns, strict=True):
        after[r] += c
    most = limit if limit is not None and limit > 0 else most_requests
    left = min(remaining_ns, cap_ns) - first.quota_ns
    return after, left, max(0, most - len(first.items))
