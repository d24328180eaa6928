"""The prefill balancer as one pure object: tier queues, engines, rounds, who pulls, batches.

The daemon (:mod:`fulcrum.state.prefill`) and the simulator (:mod:`fulcrum.sim.engine`)
are two shells around the same :class:`PrefillBalancer`: the daemon adds futures,
timers, long polls and metrics; the simulator drives it on its virtual clock. Nothing
here reads a clock, awaits or logs; every time is passed in (ns).

What it owns:

* **Tier queues.** One FIFO queue per tier (ordered by arrival; a request can be put back
  at the head of its tier with :meth:`requeue_front`). Each queued request carries its
  predicted cost ``cost_ns`` = the cost model *including* the fixed step cost ``k``
  (the quota an engine gives up to take it). A tier's queued quota is kept exactly.
* **Engines and tiers.** Engines join and leave (:meth:`add_engine`,
  :meth:`remove_engine`); every round (:meth:`redistribute` with ``reason="round"``)
  the engines are re-split across tiers by the round's demand (core ``round_demand``:
  quota that arrived + queued quota / ``backlog_rounds``; core ``allocate`` with
  hysteresis; core ``assign_engines``, least-loaded engines move). Joins, leaves and
  work for a tier with no engine ("orphan", :meth:`enqueue`) redistribute at once with
  the larger of the last round's demand and the current one; an orphan does so only
  when the engines can cover every tier with demand (otherwise the next round decides,
  which avoids moving engines on every submit).
* **Who may pull.** :meth:`choose_puller` picks, among the engines offering to pull on a
  tier (each with its remaining quota, ns, and whether it is idle), the one with the most
  remaining quota that can take the tier's head; ties to the first offered.
* **Batch taking.** :meth:`take` hands an engine the longest FIFO prefix of its tier's
  queue within ``min(remaining quota, tier batch cap)`` and ``max_batch_requests`` (an
  idle engine takes an oversize head alone), spreads it over the engine's DP ranks (core
  ``assign_ranks``) and removes it from the queue.

Rule sets (:class:`Rules`) choose between the published design (``published``) and the
improvements the simulator measured (``default``: late binding to the least-loaded rank
at a tenth of a step budget, engines that take from whichever tier's head waited longest
for its tier's scale); see BENCHMARKS.md.

Prefix affinity (:mod:`fulcrum.core.prefill.affinity`, optional: ``affinity``): a
request carrying chained block hashes costs each engine its own miss tokens
(:meth:`PrefillBalancer.cost_for`), its queued cost is the expected one (at the longest
prefix any engine holds, set by the shell), a pull takes the requests the engine holds
the longest prefixes for first, unless the tier's head waited past the fairness bound,
and an engine with room goes to a tier with a request it alone holds best (``_held_tier``).

Extension points (later issues): a leased batch returns to the head of its tier with
:meth:`requeue_front`; shells keep their own per-request data (futures, leases) keyed by
request id.
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity
from fulcrum.core.prefill.bands import after_pass, band_pass, offer_for, rank_band
from fulcrum.core.prefill.batch import BatchFill, select_batch
from fulcrum.core.prefill.chunks import DEFAULT_FLOOR_FRACTION
from fulcrum.core.prefill.fair import FairLedger, TierQueue
from fulcrum.core.prefill.items import EngineEntry, Offer, Queued, Taken
from fulcrum.core.prefill.pull import Pull
from fulcrum.core.prefill.rules import (
    DEFAULT,
    PUBLISHED,
    RULE_SETS,
    Rules,
    rules_by_name,
)
from fulcrum.core.prefill.source_view import SourceView
from fulcrum.core.prefill.tiers import (
    Assignment,
    allocate,
    assign_engines,
    round_demand,
    tier_of,
    validate_bounds,
)
from fulcrum.core.tenants import TenantPolicy

__all__ = [
    "DEFAULT",
    "PUBLISHED",
    "RULE_SETS",
    "BalancerConfig",
    "EngineEntry",
    "Offer",
    "PrefillBalancer",
    "Queued",
    "Redistribution",
    "Rules",
    "Taken",
    "rules_by_name",
]


@dataclass(frozen=True, slots=True)
class BalancerConfig:
    """Static knobs. ``bounds``: tier bounds (tokens); ``batch_cap_ns``: per-tier batch
    quota cap (ns, one per tier); ``backlog_rounds`` (>= 1); ``hysteresis`` (engines);
    ``max_batch_requests`` (>= 1); ``step_quota_ns``: the step budget (ns) that the
    late-binding horizon is counted in."""

    bounds: tuple[int, ...]
    batch_cap_ns: tuple[int, ...]
    backlog_rounds: float
    hysteresis: float
    max_batch_requests: int
    rules: Rules = RULE_SETS[DEFAULT]
    step_quota_ns: int = 1_000_000_000
    #: Lowest budget of a busy rank's step (ns; :func:`fulcrum.core.prefill.chunks.rank_budget`),
    #: by which the prefix affinity predicts when an engine mid-step pulls next (an
    #: engine with its own step budget: the same fraction of that budget).
    step_floor_ns: int = int(1_000_000_000 * DEFAULT_FLOOR_FRACTION)
    #: Minimum time (ns) an engine stays on the tier a round moved it to before another
    #: round may move it again (0 = no minimum). Joins, leaves and orphaned tiers
    #: redistribute regardless: they are not flapping, they are the fleet changing.
    min_dwell_ns: int = 0
    #: Tenants' weights, caps and the starvation bound of the queue order (issue 23).
    tenants: TenantPolicy = field(default_factory=TenantPolicy)

    @property
    def rank_horizon_ns(self) -> int | None:
        """Late-binding horizon of a rank (ns), or None when late binding is off."""
        return self.rules.binding.horizon_ns(self.step_quota_ns)

    def __post_init__(self) -> None:
        validate_bounds(self.bounds)
        if len(self.batch_cap_ns) != len(self.bounds) + 1:
            raise ValueError(f"batch_cap_ns: need one cap per tier ({len(self.bounds) + 1})")
        if self.max_batch_requests < 1:
            raise ValueError("max_batch_requests: must be >= 1")
        if self.min_dwell_ns < 0:
            raise ValueError("min_dwell_ns: must be >= 0")


@dataclass(frozen=True, slots=True)
class Redistribution:
    """Result of a redistribution: engines per tier, ``moved`` (engine, old, new tier),
    the demand used (ns per tier) and the number of moves."""

    reason: str
    counts: tuple[int, ...]
    moved: tuple[tuple[str, int, int], ...]
    demand_ns: tuple[float, ...]
    moves: int = 0


def _unpinned_targets(
    counts: npt.NDArray[np.int64], held: npt.NDArray[np.int64], free: int
) -> npt.NDArray[np.int64]:
    """Engines per tier (shape (T,)) for the ``free`` unpinned engines, given the target
    split ``counts`` (T,) and the pinned engines ``held`` (T,) each tier keeps: each tier
    gets what its target still lacks; where pinned engines leave fewer free engines than
    that, the tiers furthest from their target in relative terms give first (ties: the
    longest tier), keeping one engine in every tier whose target has one."""
    want = np.maximum(counts - held, 0).astype(np.int64)
    while int(want.sum()) > free:
        have = held + want
        # Give up from a tier that keeps >= 1 engine and has the most engines per target.
        ratio = np.where(
            (want > 0) & (have > np.minimum(counts, 1)), have / np.maximum(counts, 1), -1.0
        )
        if float(ratio.max()) < 0:
            ratio = np.where(want > 0, have.astype(np.float64), -1.0)
        t = int(len(ratio) - 1 - np.argmax(ratio[::-1]))
        want[t] -= 1
    return np.asarray(want, dtype=np.int64)


def _pinned(engines: Iterable[EngineEntry], now_ns: int, min_dwell_ns: int) -> dict[str, int]:
    """Engine -> tier of the engines a round moved less than ``min_dwell_ns`` ago."""
    return {
        e.engine_id: e.tier
        for e in engines
        if e.tier >= 0 and e.moved_at_ns is not None and now_ns - e.moved_at_ns < min_dwell_ns
    }


def _split(
    engines: list[str], previous: dict[str, int], counts: npt.NDArray[np.int64],
    loads: dict[str, int], pinned: dict[str, int],
) -> tuple[Assignment, npt.NDArray[np.int64]]:
    """Assign ``engines`` to tiers for the target ``counts`` (T,), the ``pinned`` ones
    keeping theirs; returns the assignment and the engines per tier it gives."""
    if not pinned:
        return assign_engines(engines, previous, counts, loads), counts
    held = np.bincount(list(pinned.values()), minlength=len(counts)).astype(np.int64)
    free = [e for e in engines if e not in pinned]
    targets = _unpinned_targets(counts, held, len(free))
    return assign_engines(free, previous, targets, loads), held + targets


def _quick_split(bal: PrefillBalancer, counts: npt.NDArray[np.int64],
                 reason: str) -> Assignment | None:
    """:func:`_split`'s answer when it needs no pass over the engines (None otherwise):
    every engine has its tier and ``counts`` (T,) are the tiers' counts now (a round that
    keeps the split: nobody moves, pinned or not); or, but for a round (which may pin
    engines), one engine (the last to join) has no tier and ``counts`` only add it to
    one tier (it goes there, nobody moves). So a fleet registering one engine at a time
    is not quadratic, and a round costs the engines only when it moves some."""
    have, n = bal._counts, len(bal._engines)
    if sum(have) == n and counts.tolist() == have:
        return Assignment(tiers={}, moves=0)
    if reason == "round" or sum(have) != n - 1:
        return None
    fresh = next(reversed(bal._engines.values()))
    # counts sum to one more than have: one tier differs, by that one
    grow = [t for t, (c, h) in enumerate(zip(counts.tolist(), have, strict=True)) if c != h]
    if fresh.tier >= 0 or len(grow) != 1:
        return None
    return Assignment(tiers={fresh.engine_id: grow[0]}, moves=0)


@dataclass(slots=True)
class _Tier:
    queue: TierQueue
    queued_ns: int = 0
    arrived_ns: int = 0


class PrefillBalancer:
    """Pure prefill balancer state (see module docstring). Not thread-safe: one owner."""

    def __init__(self, config: BalancerConfig) -> None:
        self.config = config
        self.bounds = config.bounds
        self.n_tiers = len(self.bounds) + 1
        self._engines: dict[str, EngineEntry] = {}
        #: Tenants' virtual times and usage, shared by the tier queues (issue 23).
        self.fair = FairLedger(config.tenants)
        self._tiers = [_Tier(TierQueue(self.fair)) for _ in range(self.n_tiers)]
        self._index: dict[str, Queued] = {}
        self._counts = [0] * self.n_tiers
        self.last_demand_ns: list[float] = [0.0] * self.n_tiers
        self.moves_total = 0
        #: Prefix affinity (None: every engine pays ``Queued.cost_ns``).
        self.affinity: Affinity | None = None
        self._serving: dict[int, dict[str, int]] = {}  # :func:`serving`; tiers change
        self.generation = 0  #: Counts redistributions and rule changes (engines' tiers).
        self.moves_log: deque[frozenset[str] | None] = deque(maxlen=64)  # :func:`_moved`
        self.busy = Busy()  #: Engines whose prices carry a load part (:func:`_seen`).

    # -- configuration --------------------------------------------------------------------

    def reconfigure(self, config: BalancerConfig) -> None:
        """Adopt new knobs (same tier bounds; ValueError otherwise)."""
        if config.bounds != self.bounds:
            raise ValueError("tier_bounds: cannot change while running")
        if config.rules.order.name != self.config.rules.order.name:
            self.fair.reset()  # another rule counts other units
        self.config = config
        self.fair.set_policy(config.tenants)
        _moved(self)  # the source and binding rules may differ

    # -- queries --------------------------------------------------------------------------

    def tier_of(self, total_tokens: int) -> int:
        """Tier index of a request of ``total_tokens`` context (tokens)."""
        return tier_of(total_tokens, self.bounds)

    def tier_for(self, total_tokens: int, blocks: Sequence[int] = ()) -> int:
        """The tier a request is queued in. Without prefix affinity (or blocks): by total
        context (:meth:`tier_of`). With it, a conversation's later turn that has grown past
        its tier's bound joins the tier of the engine holding its longest prefix when its
        cost on that engine is no more than a fresh prompt at that tier's upper bound
        costs (the tier's promise -- no long compute on a short tier's engine -- holds,
        and the holder can take it)."""
        tier = tier_of(total_tokens, self.bounds)
        aff = self.affinity
        if aff is None or not blocks or tier == 0:
            return tier
        return aff_order.holder_tier(aff, self._engines.values(), self.bounds, tier,
                                     total_tokens, blocks)

    def engines_per_tier(self) -> list[int]:
        """Engines assigned to each tier now."""
        return list(self._counts)

    def engine(self, engine_id: str) -> EngineEntry | None:
        """The engine entry, or None."""
        return self._engines.get(engine_id)

    def engine_ids(self) -> list[str]:
        """Known engine ids (join order)."""
        return list(self._engines)

    def engine_tier(self, engine_id: str) -> int:
        """The tier an engine serves (-1 when unknown or none)."""
        return -1 if (eng := self._engines.get(engine_id)) is None else eng.tier

    def queue_depth(self, tier: int) -> int:
        """Requests queued in ``tier``."""
        return len(self._tiers[tier].queue)

    def queued_ns(self, tier: int) -> int:
        """Predicted quota queued in ``tier`` (ns)."""
        return self._tiers[tier].queued_ns

    def get(self, request_id: str) -> Queued | None:
        """The queued request of that id, or None."""
        return self._index.get(request_id)

    def queued(self, tier: int, now_ns: int | None = None) -> Iterator[Queued]:
        """The queued requests of ``tier`` in take order (the order rule's, at ``now_ns``
        or the latest time given; tenants at their compute cap left out), head first."""
        fair = self.fair
        return self.config.rules.order.order(
            self._tiers[tier].queue, fair.now_ns if now_ns is None else now_ns)

    def tier_queue(self, tier: int) -> TierQueue:
        """``tier``'s queue by band and tenant (read it; change it through the balancer)."""
        return self._tiers[tier].queue

    def head(self, tier: int) -> Queued | None:
        """The head of ``tier``'s queue in take order, or None."""
        return next(self.queued(tier), None) if self._tiers[tier].queue else None

    def cost_for(self, item: Queued, engine_id: str) -> int:
        """Quota (ns) ``item`` costs ``engine_id``: with prefix affinity and block hashes,
        its miss tokens on that engine priced by the cost model (never above a global
        pool's ``cached`` would give); else ``item.cost_ns`` for every engine."""
        aff = self.affinity
        if aff is None or not item.blocks:
            return item.cost_ns
        return aff_order.matched_cost(aff, item, aff.index.match(engine_id, item.blocks))

    # -- queue ----------------------------------------------------------------------------

    def enqueue(self, item: Queued) -> Redistribution | None:
        """Queue ``item`` at the tail of its tier; returns the orphan redistribution, if
        one ran (work for a tier with no engine). ValueError on a duplicate id."""
        if item.request_id in self._index:
            raise ValueError(f"request_id: {item.request_id!r} is already queued")
        t = self._tiers[item.tier]
        t.queue.add(item)
        self.fair.now_ns = max(self.fair.now_ns, item.enqueued_ns)
        self._index[item.request_id] = item
        t.queued_ns += item.cost_ns
        t.arrived_ns += item.cost_ns
        if self._counts[item.tier] == 0 and self._engines and (
            self.config.rules.orphan.redistribute(self._can_cover_all())
        ):
            return self.redistribute("orphan")
        return None

    def requeue_front(self, items: Sequence[Queued]) -> None:
        """Put taken requests back at the head of their tiers (in the given order); their
        tenants' charges are refunded."""
        for item in reversed(items):
            t = self._tiers[item.tier]
            t.queue.add_front(item)
            self.fair.refund(item.cls.tenant, self.config.rules.order.units(item, item.cost_ns))
            self._index[item.request_id] = item
            t.queued_ns += item.cost_ns

    def remove(self, request_id: str) -> Queued | None:
        """Take a request out of its queue (cancel, expiry, drain); None when not queued."""
        item = self._index.pop(request_id, None)
        if item is None:
            return None
        t = self._tiers[item.tier]
        t.queue.discard(item)
        t.queued_ns -= item.cost_ns
        return item

    def _can_cover_all(self) -> bool:
        with_demand = sum(
            1
            for i, t in enumerate(self._tiers)
            if t.queued_ns or t.arrived_ns or self.last_demand_ns[i]
        )
        return 0 < with_demand <= len(self._engines)

    # -- engines and rounds ---------------------------------------------------------------

    def add_engine(self, engine_id: str, dp_ranks: int, step_quota_ns: int = 0) -> Redistribution:
        """A prefill engine joined (or re-joined): give it a tier at once. ``step_quota_ns``:
        its own step budget (ns; 0: the configured one; predicts its steps, see :func:`_steps`)."""
        if dp_ranks < 1 or step_quota_ns < 0:
            field = "dp_ranks: must be >= 1" if dp_ranks < 1 else "step_quota_ns: must be >= 0"
            raise ValueError(field)
        old = self._engines.pop(engine_id, None)
        self.fair.ranks += dp_ranks - (0 if old is None else old.dp_ranks)
        if old is not None and old.tier >= 0:
            self._counts[old.tier] -= 1
        self._engines[engine_id] = EngineEntry(engine_id, dp_ranks, step_quota_ns=step_quota_ns)
        return self.redistribute("join")

    def remove_engine(self, engine_id: str) -> Redistribution | None:
        """A prefill engine left: its share moves at once (None when unknown)."""
        eng = self._engines.pop(engine_id, None)
        if eng is None:
            return None
        self.fair.ranks -= eng.dp_ranks
        if eng.tier >= 0:
            self._counts[eng.tier] -= 1
        _moved(self, frozenset((engine_id,)))  # it left: no tier now
        return self.redistribute("leave")

    def note_load(self, engine_id: str, load_ns: int) -> None:
        """Record an engine's outstanding work (ns, all ranks)."""
        eng = self._engines.get(engine_id)
        if eng is not None:
            eng.load_ns = max(0, int(load_ns))

    def _demand(self, reason: str) -> list[float]:
        """Each tier's demand (ns) for a redistribution (see :meth:`redistribute`); a
        round also closes the round's arrivals."""
        current = round_demand(
            [t.arrived_ns for t in self._tiers],
            [t.queued_ns for t in self._tiers],
            self.config.backlog_rounds,
        ).tolist()
        if reason != "round":
            return [max(a, b) for a, b in zip(self.last_demand_ns, current, strict=True)]
        self.last_demand_ns = [float(x) for x in current]
        for t in self._tiers:
            t.arrived_ns = 0
        return [float(x) for x in current]

    def redistribute(self, reason: str = "round", now_ns: int | None = None) -> Redistribution:
        """Re-split engines across tiers.

        ``reason="round"`` closes a round: each tier's demand is the quota submitted to it
        this round plus its queued quota over ``backlog_rounds`` (ns) and becomes the
        last round's demand. Other reasons (join, leave, orphan) use the larger of the
        last round's demand and the current round's so far.

        Dwell: in a round given ``now_ns``, an engine that a round moved less than
        ``min_dwell_ns`` ago keeps its tier (it is *pinned*); the other engines are
        split so that each tier gets as close to its share as the pinned ones allow
        (:func:`_unpinned_targets`). Moved engines record ``now_ns``.
        """
        cfg = self.config
        demand = self._demand(reason)
        prev_counts = np.array(self._counts, dtype=np.int64)
        counts = allocate(
            len(self._engines),
            np.array(demand, dtype=np.float64),
            prev_counts if sum(self._counts) == len(self._engines) else None,
            hysteresis=cfg.hysteresis,
        )
        result = _quick_split(self, counts, reason)
        if result is None:
            pinned: dict[str, int] = {}
            if reason == "round" and now_ns is not None and cfg.min_dwell_ns > 0:
                pinned = _pinned(self._engines.values(), now_ns, cfg.min_dwell_ns)
            previous = {e.engine_id: e.tier for e in self._engines.values() if e.tier >= 0}
            loads = {e.engine_id: e.load_ns for e in self._engines.values()}
            result, counts = _split(list(self._engines), previous, counts, loads, pinned)
        moved: list[tuple[str, int, int]] = []
        for engine_id, tier in result.tiers.items():
            eng = self._engines[engine_id]
            if eng.tier != tier:
                if eng.tier >= 0 and reason == "round" and now_ns is not None:
                    eng.moved_at_ns = now_ns
                moved.append((engine_id, eng.tier, tier))
                eng.tier = tier
        self._counts = [int(x) for x in counts.tolist()]
        if moved or reason != "round":  # engines and tiers as they are now
            _moved(self, frozenset(e for e, _, _ in moved))
        self.moves_total += result.moves
        return Redistribution(
            reason=reason,
            counts=tuple(self._counts),
            moved=tuple(sorted(moved)),
            demand_ns=tuple(float(d) for d in demand),
            moves=result.moves,
        )

    # -- who pulls, what is taken (the rules of ``config.rules`` decide) ------------------

    def tier_scale_ns(self, tier: int) -> int:
        """A tier's time scale (ns): its batch cap (the urgency rule divides waits by it)."""
        return self.config.batch_cap_ns[tier]

    def has_room(self, rank_loads_ns: Sequence[int]) -> bool:
        """True when an engine with these rank loads (ns) may take more work now (the
        binding rule: late binding, its least-loaded rank under the horizon; early, idle)."""
        return self.config.rules.binding.has_room(rank_loads_ns, self.config.step_quota_ns)

    def source_tier(self, engine_id: str, rank_loads_ns: Sequence[int],
                    now_ns: int | None = None) -> int:
        """The tier ``engine_id`` (with these rank loads, ns) takes work from now (-1: none
        or unknown): the source rule's (:mod:`fulcrum.core.prefill.rules.source`; the
        default, ``urgency``, given ``now_ns``: the tier whose head waited longest for its
        tier's scale, a longer tier only within :meth:`helping_bound_ns`); under prefix
        affinity a tier with a request it alone holds best first (:func:`_held_tier`);
        every waiting engine of a dispatch at once: :func:`source_tiers`."""
        return _source(self, engine_id, rank_loads_ns, now_ns)[0]

    def helping_bound_ns(self, tier: int) -> int:
        """Longest predicted cost (ns) of a longer tier's request that an engine of
        ``tier`` may take when its source rule helps longer tiers: by default a quarter of
        its own tier's batch cap (2 s for <16K with the default 8 s cap, about the tier's
        horizon), so a short tier's engine never holds a rank for a long tier's
        minutes-long prompt -- the surge the tiers exist to absorb."""
        return self.config.rules.source.helping_bound_ns(self.config.batch_cap_ns[tier])

    def can_take(self, tier: int, offer: Offer, now_ns: int | None = None) -> bool:
        """True when the offering engine may take ``tier``'s head now (with prefix
        affinity and ``now_ns``: the first request it would take, see :meth:`take`)."""
        head = self.head(tier)
        if head is None:
            return False
        if now_ns is not None:
            order = _affinity_order(self, tier, offer.engine_id, now_ns)
            if order is not None:
                if not order:
                    return False
                head = order[0]
        return self._can_take_item(tier, offer, head)

    def _can_take_item(self, tier: int, offer: Offer, head: Queued,
                       cost: Callable[[Queued, str], int] | None = None) -> bool:
        """``cost``: :meth:`cost_for` as the caller computes it (a window's memo)."""
        loads, remaining = offer_for(offer, band_of(self, tier, head))  # the work ahead of it
        full = self.config.rules.binding.full(loads, self.config.step_quota_ns)
        if full:
            return False
        cap = self.config.batch_cap_ns[tier]
        ns = (cost or self.cost_for)(head, offer.engine_id)
        return select_batch((ns,), remaining, cap, idle=not any(loads)) >= 1

    def choose_puller(self, tier: int, offers: Sequence[Offer],
                      now_ns: int | None = None) -> int:
        """Index in ``offers`` (engines offering to pull on ``tier``, in the shell's
        deterministic order) of the engine that takes the work now, among those that can
        take the head, as the rule set's puller rule picks (``emptiest_rank``: the one
        whose least-loaded rank is emptiest, ties most remaining quota then first;
        ``most_quota``: the most remaining quota, ties first); -1 when none can (or
        nothing is queued); asked in the rule's order until one can. With prefix affinity
        and ``now_ns`` (head within the fairness bound), those holding the longest prefix
        of what they would take first (:func:`~fulcrum.core.prefill.order.pick`)."""
        rank = self.config.rules.puller.rank  # then the index: the rule's key
        w = None if now_ns is None else _affinity_window(self, tier, now_ns)
        holding = {} if w is None else w.holding()
        near = [(rank(o), i, o) for i, o in enumerate(offers) if o.engine_id in holding]
        others = _ranked_later(offers, rank, holding)
        offering = {o.engine_id for o in offers}
        got = choose(self, tier, w, near, [others], offering.__contains__, now_ns)
        return -1 if got is None else int(got[1])

    def take(
        self,
        engine_id: str,
        remaining_ns: int,
        rank_loads_ns: Sequence[int],
        *,
        limit: int | None = None,
        alive: Callable[[Queued], bool] | None = None,
        now_ns: int | None = None,
        band_loads: Mapping[float, Sequence[int]] | None = None,
    ) -> Taken:
        """A pull by ``engine_id``: select, assign ranks and remove a batch (may be empty).

        ``rank_loads_ns``: the engine's outstanding work per DP rank (ns, one per rank;
        all zero = idle). ``limit``: the engine's own request cap (the configured
        ``max_batch_requests`` applies too). ``alive``: the shell's check that a queued
        request's caller still waits; dead ones are removed and returned in ``dead``.
        ``band_loads``: :func:`fulcrum.core.prefill.bands.band_pass` runs first (ns).

        The batch is a loop over named steps (:class:`fulcrum.core.prefill.pull.Pull`):
        candidates head first, each within the helping bound, the binding rule's rank
        horizon and the batch quota, up to the first refusal. With prefix affinity and
        ``now_ns``, the candidates are the tier's first ``affinity.scan`` live requests
        by the blocks this engine holds (longest first), then FIFO -- unless the head
        waited the tier's fairness bound (FIFO then: ``affinity.max_wait_ns`` times the
        tier's batch cap over the shortest tier's); taken blocks are recorded as held.
        """
        eng = self._engines.get(engine_id)
        if eng is None:
            raise ValueError(f"engine_id: unknown prefill engine {engine_id!r}")
        loads = [max(0, int(x)) for x in rank_loads_ns]
        if len(loads) != eng.dp_ranks:
            raise ValueError(f"rank_loads_ns: must have {eng.dp_ranks} entries")
        eng.load_ns = sum(loads)
        _seen(self, eng, loads, (), (), now_ns)  # its own finish is priced from these
        tier, held = _source(self, engine_id, loads, now_ns)
        if tier < 0:
            return Taken(tier=tier)
        if held and self.affinity is not None:
            self.affinity.holder_tiers += 1
        top = _top_band(self, tier) if band_loads else None
        first = band_pass(top, loads, band_loads, remaining_ns, lambda ahead, left, band:
                          self._pass(eng, tier, ahead, left, limit, alive, now_ns, band))
        after, left, limit = after_pass(first, loads, remaining_ns, limit,
                                        self.config.max_batch_requests,
                                        self.config.batch_cap_ns[tier])
        spent = band_loads and (left <= 0 or limit == 0)  # nothing left for the usual pass
        taken = Taken(tier=tier) if spent else self._pass(eng, tier, after, left, limit,
                                                          alive, now_ns)
        if first is not None:
            taken = first.join(taken)
        if taken.items:
            eng.load_ns = sum(loads) + taken.quota_ns
        _seen(self, eng, loads, taken.ranks, taken.costs_ns, now_ns, _steps(self.config, eng))
        return taken

    def _pass(self, eng: EngineEntry, tier: int, loads: list[int], remaining_ns: int,
              limit: int | None, alive: Callable[[Queued], bool] | None, now_ns: int | None,
              band: float | None = None) -> Taken:
        """One pass of a pull by these rank loads (ns): select, commit and charge a batch
        (``band``: only requests of that band or higher)."""
        pull = _start_pull(self, eng, tier, loads, remaining_ns, limit, alive, now_ns)
        pull.band = band
        pull.band_of = lambda it: band_of(self, tier, it)
        pull.run(self.queued(tier, now_ns), alive, self.cost_for)
        taken = pull.commit(tier, loads, self.remove, now_ns)
        self._charge(taken, pull.costs, now_ns)
        return taken

    def _charge(self, taken: Taken, costs: Sequence[int], now_ns: int | None) -> None:
        """Charge each taken request's tenant its cost there (ns; its order rule's units)
        and mark its band served."""
        order, q = self.config.rules.order, self._tiers[taken.tier].queue
        for it, cost in zip(taken.items, costs, strict=True):
            self.fair.charge(it.cls.tenant, order.units(it, cost), cost, now_ns)
            q.served(it, now_ns)


def band_of(bal: PrefillBalancer, tier: int, item: Queued) -> float:
    """``item``'s band on a rank if taken now (:func:`~fulcrum.core.prefill.bands.
    rank_band`): half a band up while its tenant is under its fair share with a rival
    in its band (:meth:`TierQueue.leads`; the order rule's fair-share precedence)."""
    lead = bal.config.rules.order.precedence and bal.tier_queue(tier).leads(item)
    return rank_band(item.cls.priority, lead)


def _top_band(bal: PrefillBalancer, tier: int) -> float | None:
    """The band a pull's band pass serves in ``tier``: its top priority band, half a band
    up when two tenants share it (one may be under its share; when none is, the pass
    takes nothing); None when empty."""
    q = bal.tier_queue(tier)
    top = max(q.bands, default=None)
    if top is None:
        return None
    return rank_band(top, bal.config.rules.order.precedence and len(q.flows[top]) > 1)


def _start_pull(bal: PrefillBalancer, eng: EngineEntry, tier: int, loads: list[int],
                remaining_ns: int, limit: int | None, alive: Callable[[Queued], bool] | None,
                now_ns: int | None) -> Pull:
    """A pull's state: affinity order (dead requests met go to its list), helping bound,
    rank state and batch quota."""
    cfg = bal.config
    cap = cfg.max_batch_requests
    if limit is not None and limit > 0:
        cap = min(cap, limit)
    dead: list[Queued] = []
    order = None if now_ns is None else _affinity_order(
        bal, tier, eng.engine_id, now_ns, alive, dead)
    bound = bal.helping_bound_ns(eng.tier) if tier > eng.tier >= 0 else None
    return Pull(
        eng.engine_id, order, bound,
        cfg.rules.binding.fill(loads, cfg.step_quota_ns),
        BatchFill(remaining_ns, cfg.batch_cap_ns[tier], idle=not any(loads),
                  max_requests=cap),
        bal.affinity, dead=dead, skips=cap,
    )


@dataclass(slots=True)
class Busy:
    """Engine -> when its load part in a price (:func:`~fulcrum.core.prefill.order.
    finish_ns`) is 0 again (ns), for the engines where that was later than when they were
    last seen (:func:`_seen`): a dispatch asks each of these alone, and the others alike
    (:class:`~fulcrum.core.prefill.waiting.Waiting`). Bounded: the lapsed ones go each
    time it doubles."""

    until: dict[str, int] = field(default_factory=dict)
    kept: int = 32

    def busy_at(self, now_ns: int) -> list[str]:
        """The engines whose load part is not 0 at ``now_ns``."""
        return [e for e, t in self.until.items() if t > now_ns]


def _seen(bal: PrefillBalancer, eng: EngineEntry, *args: Any) -> None:
    """:func:`~fulcrum.core.prefill.order.seen`, and :class:`Busy` kept."""
    aff_order.seen(eng, *args)
    until, busy = eng.seen_ns + max(eng.min_rank_ns, eng.step_ns), bal.busy.until
    if until > eng.seen_ns:
        busy[eng.engine_id] = until
    else:
        busy.pop(eng.engine_id, None)
    if len(busy) > 2 * bal.busy.kept:
        for e in [e for e, t in busy.items() if t <= eng.seen_ns]:
            del busy[e]
        bal.busy.kept = max(32, len(busy))


def _steps(cfg: BalancerConfig, eng: EngineEntry) -> Callable[[Sequence[int]], int]:
    """The step predictor of ``eng`` (:func:`fulcrum.core.prefill.order.step_ns`): its own
    step budget (or the configured one), and the configured floor's fraction of it."""
    limit = eng.step_quota_ns or cfg.step_quota_ns
    floor = cfg.step_floor_ns * limit // cfg.step_quota_ns if cfg.step_quota_ns > 0 else 0
    return lambda after: aff_order.step_ns(after, limit, floor)


def _affinity_window(
    bal: PrefillBalancer, tier: int, now_ns: int,
    alive: Callable[[Queued], bool] | None = None, dead: list[Queued] | None = None,
) -> aff_order.Window | None:
    """The tier's affinity window (:func:`fulcrum.core.prefill.order.window`) over the
    take order and the engines the source rule lets serve it; None when affinity does
    not apply (off, nothing queued, or the head waited past the fairness bound: FIFO).
    The bound is ``affinity.max_wait_ns`` in the shortest tier and scales with the tier's
    time scale, its batch cap: a long tier's requests wait (and are served) on that
    scale, so its head passes a short tier's bound long before any SLO of its own.
    Its tail is the unloaded cost of a prompt at the tier's upper bound (none for the
    last tier): a grace never predicts a request's first token past it."""
    aff = bal.affinity
    if aff is None:
        return None
    caps = bal.config.batch_cap_ns
    bound = aff.max_wait_ns * caps[tier] // caps[0]
    bounds = bal.config.bounds
    tail = aff.cost_ns(bounds[tier], 0) if tier < len(bounds) else None
    return aff_order.window(aff, bal.queued(tier, now_ns), serving(bal, tier), now_ns,
                            alive, dead, bound, tail)


def serving(bal: PrefillBalancer, tier: int) -> Mapping[str, int]:
    """The engines the source rule lets serve ``tier``, each to its position in join
    order (iterated: in that order): built once per tier and kept until engines join,
    leave or move (:meth:`PrefillBalancer.redistribute`) or the rules change, not once
    per window (a dispatch over a large fleet reads it). Read it; do not change it."""
    got = bal._serving.get(tier)
    if got is None:
        src = bal.config.rules.source
        got = bal._serving[tier] = {e.engine_id: i for i, e in enumerate(
            bal._engines.values()) if src.serves(e.tier, tier)}
    return got


def _ranked_later(offers: Sequence[Offer], rank: Callable[[Offer], tuple[int, ...]],
                  skip: Mapping[str, object]) -> Iterator[aff_order.Ranked]:
    """``offers`` but those of engines in ``skip``, ranked (then by index) and sorted
    when first read: a choice made among the holders never ranks the others."""
    yield from sorted(((rank(o), i, o) for i, o in enumerate(offers)
                       if o.engine_id not in skip), key=_first)  # stable: ties by index


def _first(r: aff_order.Ranked) -> tuple[int, ...]:
    return r[0]


def _moved(bal: PrefillBalancer, engines: frozenset[str] | None = None) -> None:
    """Engines' tiers or the rules may have changed: what was kept of them is dropped,
    and ``bal.moves_log`` gets the engines that moved for the new generation (None: any
    may have, or the rules changed), for those who keep engines by tier
    (:class:`~fulcrum.core.prefill.waiting.Waiting`); its last 64 generations."""
    bal._serving.clear()
    bal.generation += 1
    bal.moves_log.append(engines)


def choose(bal: PrefillBalancer, tier: int, w: aff_order.Window | None,
           near: Iterable[aff_order.Ranked], rest: Sequence[Iterable[aff_order.Ranked]],
           offering: Callable[[str], bool], now_ns: int | None,
           plain: Sequence[aff_order.Plain] = ()) -> aff_order.Ranked | None:
    """The puller of ``tier``'s work among the able offers (their source tier is
    ``tier``; :meth:`PrefillBalancer.choose_puller`), None when none can take.

    ``near``: offers in any order, every able one whose engine is in ``w``'s
    :meth:`~aff_order.Window.holding` among them; ``rest``: more, as streams each in key
    order (read only as far as the choice needs); ``plain``: the others, of engines
    :meth:`SourceView.plain` for this dispatch and not in ``w``'s holding, in groups of
    one offer key (:class:`~aff_order.Plain`: a waiting set's,
    :class:`~fulcrum.core.prefill.waiting.Waiting`). ``w``: the tier's affinity window at
    ``now_ns`` (:func:`_affinity_window`). ``offering(engine_id)``: True for the engines
    of the able offers. A plain offer prices the head as any other plain engine does:
    each group is asked once without a window, once per load part with one."""
    near = sorted(near)
    ordered = heapq.merge(near, *rest) if rest else near
    if w is not None:
        assert now_ns is not None and bal.affinity is not None
        aff = bal.affinity
        cost = functools.partial(w.cost_for, aff)
        return aff_order.pick_ranked(
            aff, now_ns, w, lambda o, it: bal._can_take_item(tier, o, it, cost), near,
            ordered, aff_order.Pricer(aff, w, bal.engine, now_ns, offering),
            aff_order.grace_ns(bal.config.step_floor_ns), plain)
    alike: dict[tuple[object, ...], bool] = {}

    def ok(r: aff_order.Ranked) -> bool:  # a plain offer: asked once per offer key
        k = aff_order.offer_key(r[2])
        if k not in alike:
            alike[k] = bal.can_take(tier, r[2])
        return alike[k]

    return aff_order.first_able(ordered, plain, ok, lambda r: bal.can_take(tier, r[2]))


class SourceStep:
    """One dispatch's source step: :meth:`PrefillBalancer.source_tier` of each offering
    engine with the queue read once for all (:attr:`view`, a
    :class:`~fulcrum.core.prefill.source_view.SourceView`, at one ``now_ns``). An engine
    holding none of what it reads (:meth:`SourceView.plain`) is answered once per own
    tier and room: every such engine prices the tier heads alike, and a source rule reads
    the engine only through those prices (:meth:`SourceRule.source`). Both shells' steps
    (:func:`source_tiers`, :class:`~fulcrum.core.prefill.waiting.Waiting`) use it."""

    __slots__ = ("_bal", "_now", "_plain", "view")

    def __init__(self, bal: PrefillBalancer, now_ns: int | None) -> None:
        if now_ns is not None:
            bal.fair.now_ns = max(bal.fair.now_ns, now_ns)  # the clock of the order
        self._bal, self._now = bal, now_ns
        self.view = SourceView(bal, now_ns)
        self._plain: dict[tuple[int, bool], int] = {}

    def tier(self, engine_id: str, own: int, room: bool) -> int:
        """The source tier of ``engine_id``, on tier ``own`` (-1: none, or unknown: -1),
        with (``room``) or without room."""
        if own < 0:
            return -1
        if not self.view.plain(engine_id):
            return _source_of(self._bal, engine_id, own, room, self._now, self.view)[0]
        got = self._plain.get((own, room))
        if got is None:
            got = self._plain[own, room] = self._bal.config.rules.source.source(
                self.view, engine_id, own, room, self._now)
        return got


def source_tiers(bal: PrefillBalancer, offers: Sequence[Offer],
                 now_ns: int | None = None) -> list[int]:
    """:meth:`PrefillBalancer.source_tier` of every offer of one dispatch
    (:class:`SourceStep`). Per engine holding none of what the queue's heads and first
    requests read: a look-up, the binding rule's room check and a set look-up."""
    step = SourceStep(bal, now_ns)
    binding, quota, engines = bal.config.rules.binding, bal.config.step_quota_ns, bal._engines
    return [step.tier(o.engine_id, -1 if (eng := engines.get(o.engine_id)) is None
                      else eng.tier, binding.has_room(o.rank_loads_ns, quota)) for o in offers]


def _source(bal: PrefillBalancer, engine_id: str, rank_loads_ns: Sequence[int],
            now_ns: int | None, view: SourceView | None = None) -> tuple[int, bool]:
    """:meth:`PrefillBalancer.source_tier`, and whether the tier is :func:`_held_tier`'s
    rather than the source rule's (the shell counts those takes)."""
    if now_ns is not None:
        bal.fair.now_ns = max(bal.fair.now_ns, now_ns)  # the clock of the order
    eng = bal._engines.get(engine_id)
    if eng is None or eng.tier < 0:
        return -1, False
    view = SourceView(bal, now_ns) if view is None else view
    return _source_of(bal, engine_id, eng.tier, bal.has_room(rank_loads_ns), now_ns, view)


def _source_of(bal: PrefillBalancer, engine_id: str, own: int, room: bool,
               now_ns: int | None, view: SourceView) -> tuple[int, bool]:
    """:func:`_source` of an engine on tier ``own`` with (``room``) or without room."""
    best = bal.config.rules.source.source(view, engine_id, own, room, now_ns)
    tier = _held_tier(bal, view, engine_id, own, best, now_ns) if room else best
    return tier, tier != best


def _held_tier(bal: PrefillBalancer, view: SourceView, engine_id: str, own: int,
               best: int, now_ns: int | None) -> int:
    """The tier an engine with room on tier ``own`` takes from under prefix affinity: a
    tier other than ``best`` (its source rule's choice) it may serve, within that tier's
    fairness bound, whose first ``affinity.scan`` requests include one this engine alone
    holds the longest prefix of, first in tier order; else ``best``. Such a request waits
    for this engine (while it is predicted sooner), and an engine of another tier comes
    to that tier only when the source rule sends it there: before, a conversation whose
    last turn an engine of a longer tier took as a helper waited for that engine while it
    served its own tier, and often ended on another engine with a miss after all (issue
    21; BENCHMARKS.md, "Prefix affinity: a holder of another tier"). A longer tier's
    request only within the helping bound, never one of a lower priority band than
    ``best``'s head. Every offering engine runs this on every dispatch, so nothing here may
    cost per engine squared, and what it reads of the queue comes from ``view`` (read once
    per dispatch). Per tier: one C-level check that this engine holds the first block of
    any of those requests (the common case: it holds none); else per request one look-up
    when it holds none of it, else O(log blocks) for its depth (:meth:`PrefixIndex.match`)
    and one for how many engines hold the block that ends it; only when another does, a
    look-up per engine holding the request's first block (the index tracks them; held
    blocks are prefix-closed, so only they can hold the block that ends it), not a pass
    over the serving engines."""
    aff = bal.affinity
    src = bal.config.rules.source
    if aff is None or now_ns is None or not src.helps:
        return best
    head = view.head(best) if best >= 0 else None
    floor = head.cls.priority if head is not None else None
    idx, caps = aff.index, bal.config.batch_cap_ns
    for t in range(len(caps)):
        first = view.head(t)
        if t == best or first is None or not src.serves(own, t):
            continue
        if now_ns - first.enqueued_ns >= aff.max_wait_ns * caps[t] // caps[0]:
            continue  # past the fairness bound: FIFO there, nobody waits for a holder
        if not idx.holds_any(engine_id, view.firsts(t, aff.scan)):
            continue  # holds no prefix of any of them (most engines, most tiers)
        for item in view.scan(t, aff.scan):
            if (not item.blocks or (floor is not None and item.cls.priority < floor)
                    or not idx.holds(engine_id, item.blocks[0])):
                continue  # (one look-up: most engines hold nothing of most requests)
            m = idx.match(engine_id, item.blocks)
            end = item.blocks[m - 1]
            if idx.holders(end) > 1 and any(
                    e != engine_id and e in serving(bal, t) and idx.holds(e, end)
                    for e in idx.holding(item.blocks[0])):
                continue
            if t <= own or aff_order.matched_cost(aff, item, m) <= bal.helping_bound_ns(own):
                return t
    return best


def _affinity_order(
    bal: PrefillBalancer, tier: int, engine_id: str, now_ns: int,
    alive: Callable[[Queued], bool] | None = None, dead: list[Queued] | None = None,
) -> list[Queued] | None:
    """The requests ``engine_id`` may take from ``tier`` under prefix affinity, in the
    order it takes them (see :meth:`PrefillBalancer.take`); None when affinity does not
    apply."""
    w = _affinity_window(bal, tier, now_ns, alive, dead)
    if w is None:
        return None
    aff = bal.affinity
    assert aff is not None
    return aff_order.order_for(
        aff, engine_id, now_ns, w,
        aff_order.Pricer(aff, w, bal.engine, now_ns, lambda e: e == engine_id),
        aff_order.grace_ns(bal.config.step_floor_ns))
