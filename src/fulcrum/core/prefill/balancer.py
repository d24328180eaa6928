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
prefix any engine holds, set by the shell), and a pull takes the requests the engine holds
the longest prefixes for first, unless the tier's head waited past the fairness bound.

Extension points (later issues): a leased batch returns to the head of its tier with
:meth:`requeue_front`; shells keep their own per-request data (futures, leases) keyed by
request id.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from fulcrum.core.prefill.affinity import Affinity
from fulcrum.core.prefill.batch import pick_engine, select_batch
from fulcrum.core.prefill.ranks import assign_ranks
from fulcrum.core.prefill.tiers import (
    allocate,
    assign_engines,
    round_demand,
    tier_of,
    validate_bounds,
)

PUBLISHED: Final = "published"
DEFAULT: Final = "default"


@dataclass(frozen=True, slots=True)
class Rules:
    """Which balancing rules are in force (a named set; see :data:`RULE_SETS`).

    ``rank_horizon_steps`` (late binding; None = off): a pull takes the FIFO head only
    while the engine's least-loaded DP rank holds less than this many step budgets of
    outstanding work (``rank_horizon_steps x step_quota_ns``, ns), so
    work waits in the shared tier queue until a rank is about to need it, instead of
    being committed early to one engine's queue; among the engines offering to pull, the
    one whose least-loaded rank is emptiest takes the work (ties: most remaining quota).
    Off, the published rules apply: the batch is bounded by the engine's remaining quota
    and the tier cap only, and the engine with the most remaining quota takes the work.
    ``work_conserving``: an engine with room (idle, or under late binding a rank below
    the horizon) whose own tier has nothing queued takes from the nearest shorter tier
    with work (short work ends soon, so the engine is back for its own tier quickly);
    the published design keeps engines to their tier.
    ``urgency`` (with ``work_conserving``; needs the time, see :meth:`PrefillBalancer.source_tier`):
    an engine with room takes from whichever tier has the head that has waited longest
    relative to its tier's time scale (the tier's batch cap, ``BalancerConfig.batch_cap_ns``:
    8 / 32 / 128 / 512 s by default), its own tier on ties. A short tier whose engines
    fall behind is helped before its requests miss their (shorter) latency target, not
    only once the longer tier's queue is empty; a long tier's head that has waited four
    times longer than a short head (for the 4x larger scale) is taken by a short tier's
    engine with room, instead of waiting for its own tier's engines -- but only work that
    holds a rank no longer than :meth:`PrefillBalancer.helping_bound_ns` (a quarter of
    the helping engine's own batch cap), never a long tier's minutes-long prompt. On
    under prefix affinity too: there a held request waits for its holder only while the
    holder is predicted to finish it sooner (:meth:`PrefillBalancer.take`), so a helper
    never idles for a busy holder, and late binding applies to every request (binding
    held work early piled it on busy ranks: both cost goodput, see BENCHMARKS.md
    "Prefix affinity").
    ``orphan_gate``: an orphan tier gets an engine at once only when the engines can
    cover every tier with demand.
    """

    name: str = DEFAULT
    rank_horizon_steps: float | None = None
    work_conserving: bool = False
    orphan_gate: bool = True
    urgency: bool = False


RULE_SETS: Final[dict[str, Rules]] = {
    PUBLISHED: Rules(PUBLISHED),
    DEFAULT: Rules(DEFAULT, rank_horizon_steps=0.1, work_conserving=True, urgency=True),
}
"""Named rule sets: ``published`` (the letter of the design) and ``default``."""


def rules_by_name(name: str) -> Rules:
    """The rule set called ``name``; ValueError naming the known ones otherwise."""
    try:
        return RULE_SETS[name]
    except KeyError:
        known = ", ".join(RULE_SETS)
        raise ValueError(f"rules: unknown name {name!r} (known: {known})") from None


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
    #: Minimum time (ns) an engine stays on the tier a round moved it to before another
    #: round may move it again (0 = no minimum). Joins, leaves and orphaned tiers
    #: redistribute regardless: they are not flapping, they are the fleet changing.
    min_dwell_ns: int = 0

    @property
    def rank_horizon_ns(self) -> int | None:
        """Late-binding horizon of a rank (ns), or None when late binding is off."""
        steps = self.rules.rank_horizon_steps
        return None if steps is None else int(steps * self.step_quota_ns)

    def __post_init__(self) -> None:
        validate_bounds(self.bounds)
        if len(self.batch_cap_ns) != len(self.bounds) + 1:
            raise ValueError(f"batch_cap_ns: need one cap per tier ({len(self.bounds) + 1})")
        if self.max_batch_requests < 1:
            raise ValueError("max_batch_requests: must be >= 1")
        if self.min_dwell_ns < 0:
            raise ValueError("min_dwell_ns: must be >= 0")


@dataclass(slots=True, eq=False)
class Queued:
    """A queued request: tokens, tier, predicted cost (ns, with ``k``), enqueue time (ns),
    and its prefix as chained block hashes (empty: none given)."""

    request_id: str
    total: int
    cached: int
    tier: int
    cost_ns: int
    enqueued_ns: int
    blocks: tuple[int, ...] = ()
    #: Prefix matches per engine memoised by the affinity index (bounded by engines).
    held: dict[str, tuple[int, int, int]] = field(default_factory=dict, repr=False)


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


@dataclass(frozen=True, slots=True)
class Offer:
    """An engine offering to pull now: its id, remaining quota (ns) and outstanding work
    per DP rank (ns; all zero = idle)."""

    engine_id: str
    remaining_ns: int
    rank_loads_ns: Sequence[int]


@dataclass(frozen=True, slots=True)
class Taken:
    """Result of :meth:`PrefillBalancer.take`: ``items[i]`` went to DP rank ``ranks[i]``
    (FIFO order), from ``tier``; ``quota_ns`` their summed cost; ``dead`` the requests
    found dead (caller gone) on the way, removed from the queue, not delivered."""

    tier: int
    items: tuple[Queued, ...] = ()
    ranks: tuple[int, ...] = ()
    quota_ns: int = 0
    dead: tuple[Queued, ...] = ()


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


def _late_binding(costs: Iterator[int], loads: Sequence[int],
                  horizon_ns: int) -> Iterator[int]:
    """The FIFO costs an engine may take under late binding: each goes to the
    least-loaded rank (as core ``assign_ranks`` will place it) while that rank's load is
    below ``horizon_ns``; the first that would land on a rank at or above it ends the
    prefix."""
    heap = [(int(x), r) for r, x in enumerate(loads)]
    heapq.heapify(heap)
    for cost in costs:
        load, r = heap[0]
        if load >= horizon_ns:
            return
        heapq.heapreplace(heap, (load + int(cost), r))
        yield cost


def _seen(eng: EngineEntry, loads: Sequence[int], now_ns: int | None) -> None:
    """Remember ``eng``'s least-loaded rank load (ns) as of ``now_ns`` (its pull)."""
    if now_ns is not None:
        eng.min_rank_ns = min(loads, default=0)
        eng.seen_ns = now_ns


@dataclass(slots=True)
class _Tier:
    queue: OrderedDict[str, Queued] = field(default_factory=OrderedDict)
    queued_ns: int = 0
    arrived_ns: int = 0


class PrefillBalancer:
    """Pure prefill balancer state (see module docstring). Not thread-safe: one owner."""

    def __init__(self, config: BalancerConfig) -> None:
        self.config = config
        self.bounds = config.bounds
        self.n_tiers = len(self.bounds) + 1
        self._tiers = [_Tier() for _ in range(self.n_tiers)]
        self._index: dict[str, Queued] = {}
        self._engines: dict[str, EngineEntry] = {}
        self._counts = [0] * self.n_tiers
        self.last_demand_ns: list[float] = [0.0] * self.n_tiers
        self.moves_total = 0
        #: Prefix affinity (None: every engine pays ``Queued.cost_ns``).
        self.affinity: Affinity | None = None

    # -- configuration --------------------------------------------------------------------

    def reconfigure(self, config: BalancerConfig) -> None:
        """Adopt new knobs (same tier bounds; ValueError otherwise)."""
        if config.bounds != self.bounds:
            raise ValueError("tier_bounds: cannot change while running")
        self.config = config

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
        best, held = None, 0
        for e in self._engines.values():
            if 0 <= e.tier < tier:
                m = aff.index.match(e.engine_id, blocks)
                if m > held or (m == held and best is not None and e.tier < best.tier):
                    best, held = e, m
        if best is None or held == 0:
            return tier
        bound = self.bounds[best.tier]
        if aff.cost_on(best.engine_id, total_tokens, blocks) <= aff.cost_ns(bound, 0):
            return best.tier
        return tier

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
        eng = self._engines.get(engine_id)
        return -1 if eng is None else eng.tier

    def queue_depth(self, tier: int) -> int:
        """Requests queued in ``tier``."""
        return len(self._tiers[tier].queue)

    def queued_ns(self, tier: int) -> int:
        """Predicted quota queued in ``tier`` (ns)."""
        return self._tiers[tier].queued_ns

    def get(self, request_id: str) -> Queued | None:
        """The queued request of that id, or None."""
        return self._index.get(request_id)

    def queued(self, tier: int) -> Iterator[Queued]:
        """The queued requests of ``tier``, head first."""
        return iter(self._tiers[tier].queue.values())

    def head(self, tier: int) -> Queued | None:
        """The head of ``tier``'s queue, or None."""
        q = self._tiers[tier].queue
        return next(iter(q.values())) if q else None

    def cost_for(self, item: Queued, engine_id: str) -> int:
        """Quota (ns) ``item`` costs ``engine_id``: with prefix affinity and block hashes,
        its miss tokens on that engine priced by the cost model (never above a global
        pool's ``cached`` would give); else ``item.cost_ns`` for every engine."""
        aff = self.affinity
        if aff is None or not item.blocks:
            return item.cost_ns
        return min(item.cost_ns if item.cached else aff.cost_ns(item.total, 0),
                   aff.cost_on(engine_id, item.total, item.blocks))

    # -- queue ----------------------------------------------------------------------------

    def enqueue(self, item: Queued) -> Redistribution | None:
        """Queue ``item`` at the tail of its tier; returns the orphan redistribution, if
        one ran (work for a tier with no engine). ValueError on a duplicate id."""
        if item.request_id in self._index:
            raise ValueError(f"request_id: {item.request_id!r} is already queued")
        t = self._tiers[item.tier]
        t.queue[item.request_id] = item
        self._index[item.request_id] = item
        t.queued_ns += item.cost_ns
        t.arrived_ns += item.cost_ns
        if self._counts[item.tier] == 0 and self._engines and (
            not self.config.rules.orphan_gate or self._can_cover_all()
        ):
            return self.redistribute("orphan")
        return None

    def requeue_front(self, items: Sequence[Queued]) -> None:
        """Put taken requests back at the head of their tiers (in the given order)."""
        for item in reversed(items):
            t = self._tiers[item.tier]
            t.queue[item.request_id] = item
            t.queue.move_to_end(item.request_id, last=False)
            self._index[item.request_id] = item
            t.queued_ns += item.cost_ns

    def remove(self, request_id: str) -> Queued | None:
        """Take a request out of its queue (cancel, expiry, drain); None when not queued."""
        item = self._index.pop(request_id, None)
        if item is None:
            return None
        t = self._tiers[item.tier]
        del t.queue[request_id]
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

    def add_engine(self, engine_id: str, dp_ranks: int) -> Redistribution:
        """A prefill engine joined (or re-joined): give it a tier at once."""
        if dp_ranks < 1:
            raise ValueError("dp_ranks: must be >= 1")
        old = self._engines.pop(engine_id, None)
        if old is not None and old.tier >= 0:
            self._counts[old.tier] -= 1
        self._engines[engine_id] = EngineEntry(engine_id, dp_ranks)
        return self.redistribute("join")

    def remove_engine(self, engine_id: str) -> Redistribution | None:
        """A prefill engine left: its share moves at once (None when unknown)."""
        eng = self._engines.pop(engine_id, None)
        if eng is None:
            return None
        if eng.tier >= 0:
            self._counts[eng.tier] -= 1
        return self.redistribute("leave")

    def note_load(self, engine_id: str, load_ns: int) -> None:
        """Record an engine's outstanding work (ns, all ranks)."""
        eng = self._engines.get(engine_id)
        if eng is not None:
            eng.load_ns = max(0, int(load_ns))

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
        current = round_demand(
            [t.arrived_ns for t in self._tiers],
            [t.queued_ns for t in self._tiers],
            cfg.backlog_rounds,
        ).tolist()
        if reason == "round":
            demand = current
            self.last_demand_ns = [float(x) for x in current]
            for t in self._tiers:
                t.arrived_ns = 0
        else:
            demand = [max(a, b) for a, b in zip(self.last_demand_ns, current, strict=True)]
        previous = {e.engine_id: e.tier for e in self._engines.values() if e.tier >= 0}
        prev_counts = np.array(self._counts, dtype=np.int64)
        counts = allocate(
            len(self._engines),
            np.array(demand, dtype=np.float64),
            prev_counts if len(previous) == len(self._engines) else None,
            hysteresis=cfg.hysteresis,
        )
        loads = {e.engine_id: e.load_ns for e in self._engines.values()}
        pinned: dict[str, int] = {}
        if reason == "round" and now_ns is not None and cfg.min_dwell_ns > 0:
            pinned = {
                e.engine_id: e.tier
                for e in self._engines.values()
                if e.tier >= 0
                and e.moved_at_ns is not None
                and now_ns - e.moved_at_ns < cfg.min_dwell_ns
            }
        if pinned:
            held = np.bincount(list(pinned.values()), minlength=len(counts)).astype(np.int64)
            free = [e for e in self._engines if e not in pinned]
            targets = _unpinned_targets(counts, held, len(free))
            result = assign_engines(free, previous, targets, loads)
            counts = held + targets
        else:
            result = assign_engines(list(self._engines), previous, counts, loads)
        moved: list[tuple[str, int, int]] = []
        for engine_id, tier in result.tiers.items():
            eng = self._engines[engine_id]
            if eng.tier != tier:
                if eng.tier >= 0 and reason == "round" and now_ns is not None:
                    eng.moved_at_ns = now_ns
                moved.append((engine_id, eng.tier, tier))
                eng.tier = tier
        self._counts = [int(x) for x in counts.tolist()]
        self.moves_total += result.moves
        return Redistribution(
            reason=reason,
            counts=tuple(self._counts),
            moved=tuple(sorted(moved)),
            demand_ns=tuple(float(d) for d in demand),
            moves=result.moves,
        )

    # -- who pulls, what is taken ---------------------------------------------------------

    def has_room(self, rank_loads_ns: Sequence[int]) -> bool:
        """True when an engine with these rank loads (ns) may take more work now: under
        late binding, its least-loaded rank is below the horizon; else it is idle."""
        h = self.config.rank_horizon_ns
        if h is None:
            return not any(rank_loads_ns)
        return min(rank_loads_ns, default=0) < h

    def source_tier(self, engine_id: str, rank_loads_ns: Sequence[int],
                    now_ns: int | None = None) -> int:
        """The tier ``engine_id`` (with these rank loads, ns) takes work from now (-1: none).

        Its own tier; under work-conserving rules, an engine with room (:meth:`has_room`)
        whose own tier has nothing queued takes from the nearest *shorter* tier with work
        (never a longer one: without the time there is no measure of how long that
        work has waited). Under ``urgency`` rules and given ``now_ns``, an engine with room
        takes from the tier whose head has waited the longest in units of its tier's time
        scale (``batch_cap_ns``; ties: its own tier, then the shorter tier); a longer tier
        only when its head costs at most :meth:`helping_bound_ns` of the engine's tier
        (then it holds one rank briefly, and the MIN step budget keeps the engine's steps
        as short as its lightest busy rank, so its other ranks keep serving short work).
        """
        eng = self._engines.get(engine_id)
        if eng is None or eng.tier < 0:
            return -1
        own = eng.tier
        rules = self.config.rules
        if not rules.work_conserving:
            return own
        if not self.has_room(rank_loads_ns):
            return own
        if rules.urgency and now_ns is not None:
            scale = self.config.batch_cap_ns
            bound = self.helping_bound_ns(own)
            best, most = own, -1.0
            for t in (own, *range(self.n_tiers)):
                q = self._tiers[t].queue
                if not q:
                    continue
                head = next(iter(q.values()))
                if t > own and self.cost_for(head, engine_id) > bound:
                    continue  # a long prompt would hold this engine's rank too long
                waited = max(0, now_ns - head.enqueued_ns) / max(1, scale[t])
                if waited > most:
                    best, most = t, waited
            return best
        if self._tiers[own].queue:
            return own
        for t in range(own - 1, -1, -1):
            if self._tiers[t].queue:
                return t
        return own

    def helping_bound_ns(self, tier: int) -> int:
        """Longest predicted cost (ns) of a longer tier's request that an engine of
        ``tier`` may take under ``urgency`` rules: a quarter of its own tier's batch cap
        (2 s for <16K with the default 8 s cap, about the tier's horizon), so a short
        tier's engine never holds a rank for a long tier's minutes-long prompt -- the
        surge the tiers exist to absorb."""
        return self.config.batch_cap_ns[tier] // 4

    def can_take(self, tier: int, offer: Offer, now_ns: int | None = None) -> bool:
        """True when the offering engine may take ``tier``'s head now (with prefix
        affinity and ``now_ns``: the first request it would take, see :meth:`take`)."""
        head = self.head(tier)
        if head is None:
            return False
        if now_ns is not None and self.affinity is not None:
            order = self._affinity_order(tier, offer.engine_id, now_ns)
            if order is not None:
                if not order:
                    return False
                head = order[0]
        return self._can_take_item(tier, offer, head)

    def _can_take_item(self, tier: int, offer: Offer, head: Queued) -> bool:
        loads = offer.rank_loads_ns
        h = self.config.rank_horizon_ns
        if h is not None and min(loads, default=0) >= h:
            return False
        cap = self.config.batch_cap_ns[tier]
        cost = self.cost_for(head, offer.engine_id)
        return select_batch((cost,), offer.remaining_ns, cap, idle=not any(loads)) >= 1

    def choose_puller(self, tier: int, offers: Sequence[Offer],
                      now_ns: int | None = None) -> int:
        """Index in ``offers`` (engines offering to pull on ``tier``, in the shell's
        deterministic order) of the engine that takes the work now, among those that can
        take the head: under late binding the one whose least-loaded rank is emptiest
        (ties: most remaining quota, then first), else the most remaining quota (ties:
        first); -1 when none can (or nothing is queued). With prefix affinity and
        ``now_ns`` (head within the fairness bound), the engine holding the longest prefix
        of the head comes first."""
        w = None if now_ns is None else self._affinity_window(tier, now_ns)
        if w is None:
            able = [i for i, o in enumerate(offers) if self.can_take(tier, o)]
        else:
            assert now_ns is not None
            firsts: dict[int, Queued] = {}
            for i, o in enumerate(offers):
                order = self._order_for(o.engine_id, now_ns, *w)
                if order and self._can_take_item(tier, o, order[0]):
                    firsts[i] = order[0]
            able = list(firsts)
            # The engine holding the longest prefix of the work it would take comes first.
            pos = {id(it): j for j, it in enumerate(w[0])}
            held = {i: w[1][pos[id(firsts[i])]].get(offers[i].engine_id, 0) for i in able}
            top = max(held.values(), default=0)
            if top > 0:
                able = [i for i in able if held[i] == top]
        if not able:
            return -1
        if self.config.rank_horizon_ns is not None:
            return min(able, key=lambda i: (
                min(offers[i].rank_loads_ns, default=0), -offers[i].remaining_ns, i))
        return able[pick_engine([offers[i].remaining_ns for i in able])]

    def _affinity_window(
        self, tier: int, now_ns: int,
        alive: Callable[[Queued], bool] | None = None, dead: list[Queued] | None = None,
    ) -> tuple[list[Queued], list[dict[str, int]]] | None:
        """The tier's first ``affinity.scan`` live requests and, for each, the leading
        blocks every engine that may serve the tier holds (computed once per decision);
        None when affinity does not apply (off, nothing queued, or the head waited past
        the fairness bound: FIFO). Dead requests met are appended to ``dead``."""
        aff = self.affinity
        if aff is None:
            return None
        window: list[Queued] = []
        for item in self._tiers[tier].queue.values():
            if alive is not None and not alive(item):
                if dead is not None:
                    dead.append(item)
                continue
            window.append(item)
            if len(window) >= aff.scan:
                break
        if not window or now_ns - window[0].enqueued_ns >= aff.max_wait_ns:
            return None
        # Who may take it: its tier's engines, longer tiers' under work conservation, and
        # under urgency any engine with a tier (urgency crosses tiers both ways).
        rules = self.config.rules
        serving = [e.engine_id for e in self._engines.values()
                   if e.tier == tier or (rules.work_conserving and e.tier > tier)
                   or (rules.urgency and e.tier >= 0)]
        idx = aff.index
        held = [
            {e: m for e in serving if (m := idx.match_memo(e, it.blocks, it.held))}
            if it.blocks else {}
            for it in window
        ]
        return window, held

    def _rank_free_ns(self, engine_id: str, now_ns: int) -> int:
        """Predicted wait (ns) before ``engine_id``'s least-loaded rank is free: that
        rank's load after its latest pull, drained by the time since (1 ns per ns)."""
        eng = self._engines.get(engine_id)
        if eng is None:
            return 0
        return max(0, eng.min_rank_ns - max(0, now_ns - eng.seen_ns))

    def _cost_matched(self, item: Queued, matched: int) -> int:
        """:meth:`cost_for` on an engine known to hold ``matched`` leading blocks of
        ``item`` (no second index look-up)."""
        aff = self.affinity
        assert aff is not None
        c = aff.index.cached_tokens(matched, item.total)
        return min(item.cost_ns if item.cached else aff.cost_ns(item.total, 0),
                   aff.cost_ns(item.total - c, c))

    def _holder_sooner(self, item: Queued, held: dict[str, int], engine_id: str,
                       mine: int, now_ns: int) -> bool:
        """True when an engine holding more of ``item``'s prefix than ``engine_id``
        (``mine`` blocks; ``held``: engine -> leading blocks held) is predicted to finish
        it first: its rank's remaining work plus its cost there, against ``engine_id``'s
        least-loaded rank plus its cost here. O(holders), no index look-up."""
        own = self._rank_free_ns(engine_id, now_ns) + self._cost_matched(item, mine)
        return any(
            self._rank_free_ns(e, now_ns) + self._cost_matched(item, m) < own
            for e, m in held.items() if m > mine and e != engine_id
        )

    def _order_for(self, engine_id: str, now_ns: int, window: list[Queued],
                   held: list[dict[str, int]]) -> list[Queued]:
        """``engine_id``'s take order over an affinity window. A request waits for an
        engine holding a longer prefix of it only while that holder is predicted to
        finish it sooner (:meth:`_holder_sooner`), and never once it has waited
        ``max_wait_ns``; the rest go longest held prefix first, FIFO among equals."""
        aff = self.affinity
        assert aff is not None
        ranked: list[tuple[int, int, Queued]] = []
        for i, (item, h) in enumerate(zip(window, held, strict=True)):
            mine = h.get(engine_id, 0)
            if (h and now_ns - item.enqueued_ns < aff.max_wait_ns
                    and max(h.values()) > mine
                    and self._holder_sooner(item, h, engine_id, mine, now_ns)):
                continue  # its holder is predicted to finish it sooner
            ranked.append((-mine, i, item))
        ranked.sort(key=lambda x: (x[0], x[1]))
        return [x[2] for x in ranked]

    def _affinity_order(
        self, tier: int, engine_id: str, now_ns: int,
        alive: Callable[[Queued], bool] | None = None, dead: list[Queued] | None = None,
    ) -> list[Queued] | None:
        """The requests ``engine_id`` may take from ``tier`` under prefix affinity, in the
        order it takes them (see :meth:`take`); None when affinity does not apply."""
        w = self._affinity_window(tier, now_ns, alive, dead)
        return None if w is None else self._order_for(engine_id, now_ns, *w)

    def take(
        self,
        engine_id: str,
        remaining_ns: int,
        rank_loads_ns: Sequence[int],
        *,
        limit: int | None = None,
        alive: Callable[[Queued], bool] | None = None,
        now_ns: int | None = None,
    ) -> Taken:
        """A pull by ``engine_id``: select, assign ranks and remove a batch (may be empty).

        ``rank_loads_ns``: the engine's outstanding work per DP rank (ns, one per rank;
        all zero = idle). ``limit``: the engine's own request cap (the configured
        ``max_batch_requests`` applies too). ``alive``: the shell's check that a queued
        request's caller still waits; dead ones are removed and returned in ``dead``.
        The engine's known load becomes the rank loads after the batch.

        With prefix affinity and ``now_ns`` given, the batch is taken from the tier's first
        ``affinity.scan`` live requests ordered by the blocks this engine holds of each
        (longest first, FIFO among equals), then the rest FIFO -- unless the tier's head
        has waited ``affinity.max_wait_ns`` or longer, then FIFO (a fairness override).
        Taken requests' blocks are recorded as held by the engine (approximate index).
        """
        eng = self._engines.get(engine_id)
        if eng is None:
            raise ValueError(f"engine_id: unknown prefill engine {engine_id!r}")
        loads = [max(0, int(x)) for x in rank_loads_ns]
        if len(loads) != eng.dp_ranks:
            raise ValueError(f"rank_loads_ns: must have {eng.dp_ranks} entries")
        eng.load_ns = sum(loads)
        _seen(eng, loads, now_ns)
        idle = not any(loads)
        tier = self.source_tier(engine_id, loads, now_ns)
        if tier < 0:
            return Taken(tier=tier)
        cap = self.config.max_batch_requests
        if limit is not None and limit > 0:
            cap = min(cap, limit)
        queue = self._tiers[tier].queue
        live: list[Queued] = []
        dead: list[Queued] = []

        aff = self.affinity

        order = None if now_ns is None else self._affinity_order(
            tier, engine_id, now_ns, alive, dead)

        def candidates() -> Iterator[Queued]:
            if order is not None:
                yield from order
                return
            for item in queue.values():
                if alive is not None and not alive(item):
                    dead.append(item)
                    continue
                yield item

        # Work of a longer tier: only requests that hold a rank no longer than the
        # engine's own tier allows (see :meth:`helping_bound_ns`), FIFO up to the first
        # that would.
        bound = self.helping_bound_ns(eng.tier) if tier > eng.tier >= 0 else None

        def costs() -> Iterator[int]:
            for item in candidates():
                cost = self.cost_for(item, engine_id)
                if bound is not None and cost > bound:
                    return
                live.append(item)
                yield cost

        horizon = self.config.rank_horizon_ns
        if horizon is not None:
            costs_iter: Iterator[int] = _late_binding(costs(), loads, horizon)
        else:
            costs_iter = costs()
        n = select_batch(
            costs_iter, remaining_ns, self.config.batch_cap_ns[tier], idle=idle,
            max_requests=cap,
        )
        for item in dead:
            self.remove(item.request_id)
        chosen = live[:n]
        if not chosen:
            return Taken(tier=tier, dead=tuple(dead))
        item_costs = [self.cost_for(it, engine_id) for it in chosen]
        plan = assign_ranks(loads, item_costs)
        if aff is not None and now_ns is not None and order is None:
            aff.overrides += 1  # the head waited past the fairness bound: FIFO
        for it in chosen:
            self.remove(it.request_id)
            if aff is not None and it.blocks:
                hit = aff.taken(engine_id, it.tier, it.blocks)
                aff.hits += int(bool(hit) and order is not None)
        eng.load_ns = sum(plan.loads_ns)
        _seen(eng, plan.loads_ns, now_ns)
        return Taken(
            tier=tier,
            items=tuple(chosen),
            ranks=plan.ranks,
            quota_ns=sum(item_costs),
            dead=tuple(dead),
        )
