"""The balancer's records: a queued request, an engine entry, a pull offer, a pull's result.

Shared by :mod:`fulcrum.core.prefill.balancer`, the pull steps
(:mod:`fulcrum.core.prefill.pull`) and the prefill rules
(:mod:`fulcrum.core.prefill.rules`); the balancer re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass


@dataclass(slots=True, eq=False)
class Queued:
    """A queued request: tokens, tier, predicted cost (ns, with ``k``), enqueue time (ns),
    its prefix as chained block hashes (empty: none given) and its class (tenant,
    priority, TTFT deadline; issue 23)."""

    request_id: str
    total: int
    cached: int
    tier: int
    cost_ns: int
    enqueued_ns: int
    blocks: tuple[int, ...] = ()
    #: Prefix matches per engine memoised by the affinity index (bounded by engines).
    held: dict[str, tuple[int, int, int]] = field(default_factory=dict, repr=False)
    cls: RequestClass = DEFAULT_CLASS


@dataclass(slots=True, eq=False)
class EngineEntry:
    """An engine as the balancer knows it: DP ranks, tier (-1: none), last known
    outstanding work (ns, all ranks: the rank loads of its latest pull plus what that
    pull took), which decides who moves at a redistribution."""

    engine_id: str
    dp_ranks: int
    tier: int = -1
    load_ns: int = 0
    #: When a round last moved the engine to another tier (ns; None: never).
    moved_at_ns: int | None = None
    #: Load of its least-loaded rank after its latest pull (ns), and when that was (ns).
    min_rank_ns: int = 0
    seen_ns: int = 0
    #: Predicted length of the step it started after its latest pull (ns; 0: none):
    #: until then it pulls nothing (engines pull between steps).
    step_ns: int = 0
    #: Its own step budget (ns; 0: the balancer's ``step_quota_ns``).
    step_quota_ns: int = 0


@dataclass(frozen=True, slots=True)
class Offer:
    """An engine offering to pull now: its id, remaining quota (ns) and outstanding work
    per DP rank (ns; all zero = idle); ``band_loads``: per priority band it holds, the
    work per rank of that band or higher (ns; :mod:`fulcrum.core.prefill.bands`; None:
    not reported)."""

    engine_id: str
    remaining_ns: int
    rank_loads_ns: Sequence[int]
    band_loads: Mapping[float, Sequence[int]] | None = None


@dataclass(frozen=True, slots=True)
class Taken:
    """Result of :meth:`PrefillBalancer.take`: ``items[i]`` went to DP rank ``ranks[i]``
    (FIFO order), from ``tier``; ``quota_ns`` their summed cost; ``dead`` the requests
    found dead (caller gone) on the way, removed from the queue, not delivered;
    ``costs_ns[i]``: ``items[i]``'s cost on the engine (ns); ``banded``: how many of the
    first items a band pass took (bound by the work ahead of their band); ``bands[i]``:
    ``items[i]``'s band on its rank (:func:`fulcrum.core.prefill.bands.rank_band`: its
    priority, + 0.5 with fair-share precedence)."""

    tier: int
    items: tuple[Queued, ...] = ()
    ranks: tuple[int, ...] = ()
    quota_ns: int = 0
    dead: tuple[Queued, ...] = ()
    costs_ns: tuple[int, ...] = ()
    banded: int = 0
    bands: tuple[float, ...] = ()

    def join(self, then: Taken) -> Taken:
        """This band pass's batch followed by ``then`` (the usual pass of the same pull)."""
        return Taken(self.tier, self.items + then.items, self.ranks + then.ranks,
                     self.quota_ns + then.quota_ns, self.dead + then.dead,
                     self.costs_ns + then.costs_ns, banded=len(self.items),
                     bands=self.bands + then.bands)
