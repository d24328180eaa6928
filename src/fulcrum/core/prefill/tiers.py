"""Prefill tiers: which tier a request belongs to, and how many engines each tier owns.

Rule (SPEC section 3, level 1):

* **Tier of a request.** By total context length (tokens, cached + to compute). With
  ascending bounds ``(16K, 64K, 256K)`` (K = 1,024 tokens; configurable) the tiers are
  ``[0, 16K)``, ``[16K, 64K)``, ``[64K, 256K)`` and ``[256K, inf)``: tier ``i`` is the
  number of bounds ``<= total``.
* **Engines per tier.** Every round, the ``n`` live engines are split across tiers in
  proportion to each tier's share of compute-quota demand (ns) in the previous round
  (:func:`round_demand`: the quota that arrived in the round plus the still-queued quota
  spread over ``backlog_rounds`` rounds):

  1. while engines suffice (``n >=`` number of tiers with demand), every tier with demand
     gets at least one engine: tiers whose proportional share is below one are pinned to
     one engine and the rest is re-shared among the others, until stable;
  2. the unpinned shares are rounded by largest remainder (ties: larger demand first,
     then lower tier index), so the counts sum to ``n`` exactly;
  3. when engines do not suffice, the tiers of largest demand get one engine each;
     tiers without demand get no engine, unless no tier has demand: then the previous
     split is kept (or, without one, the engines are spread evenly).

  **Hysteresis** (engines, >= 0): the previous split is kept unchanged when it is still
  feasible (sums to ``n``, honours rule 1), holds no engine on a tier without demand
  while another tier has demand, and no tier's count is more than
  ``hysteresis`` engines away from its ideal (pinned, fractional) share. With
  ``hysteresis = 0`` the result is always the largest-remainder split.
* **Which engines move.** :func:`assign_engines` keeps every engine in its previous tier
  while that tier still has room. An over-full tier gives up its engines with the least
  outstanding work first (ties: highest ids first); these and new engines (no work,
  lowest ids first) fill the under-full tiers in tier order, the emptiest engines going
  to the shortest tiers. An engine in the middle of a 256K-token prefill thus stays
  with the long tiers where it can, instead of being handed short requests that would
  run in its full-budget steps while its other ranks wait. Deterministic.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

NAME: Final = "quota_share"

K: Final = 1_024
DEFAULT_TIER_BOUNDS: Final[tuple[int, ...]] = (16 * K, 64 * K, 256 * K)
"""Default tier bounds (tokens): four tiers ``<16K, 16K-64K, 64K-256K, >=256K``."""

DEFAULT_HYSTERESIS: Final = 1.0
"""Default hysteresis (engines): keep the split while every tier is within one engine."""

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def validate_bounds(bounds: Sequence[int]) -> tuple[int, ...]:
    """Return ``bounds`` as a tuple; raise ValueError unless strictly ascending and > 0."""
    out = tuple(int(b) for b in bounds)
    if not out:
        raise ValueError("tier_bounds: need at least one bound")
    if out[0] <= 0 or any(x >= y for x, y in itertools.pairwise(out)):
        raise ValueError(f"tier_bounds: must be strictly ascending and > 0, got {out}")
    return out


def tier_label(bounds: Sequence[int], tier: int) -> str:
    """Human/metric label of a tier, e.g. ``"16K-64K"`` or ``">=256K"`` (bounded set)."""

    def fmt(x: int) -> str:
        return f"{x // K}K" if x % K == 0 else str(x)

    if tier == 0:
        return f"<{fmt(bounds[0])}"
    if tier == len(bounds):
        return f">={fmt(bounds[-1])}"
    return f"{fmt(bounds[tier - 1])}-{fmt(bounds[tier])}"


def tier_of(total_tokens: int, bounds: Sequence[int] = DEFAULT_TIER_BOUNDS) -> int:
    """Tier index (0 .. len(bounds)) of a request of ``total_tokens`` context (tokens)."""
    if total_tokens < 0:
        raise ValueError(f"total_tokens: must be >= 0, got {total_tokens}")
    return bisect.bisect_right(bounds, total_tokens)


def tier_of_array(
    total_tokens: npt.ArrayLike, bounds: Sequence[int] = DEFAULT_TIER_BOUNDS
) -> IntArray:
    """Vectorised :func:`tier_of`; ``total_tokens`` of any shape, result of the same shape."""
    t = np.asarray(total_tokens, dtype=np.int64)
    out: IntArray = np.searchsorted(np.asarray(bounds, dtype=np.int64), t, side="right").astype(
        np.int64
    )
    return out


DEFAULT_BACKLOG_ROUNDS: Final = 8.0
"""Default horizon (rounds) over which a tier's queued quota counts toward its demand."""


def round_demand(
    arrived_ns: npt.ArrayLike, queued_ns: npt.ArrayLike, backlog_rounds: float
) -> FloatArray:
    """Quota demand of each tier for one round (ns), shape (T,).

    ``arrived_ns``: quota submitted to each tier during the round (ns);
    ``queued_ns``: quota still queued at the end of the round (ns);
    ``backlog_rounds`` (>= 1): the backlog counts as if it were spread over this many
    rounds. ``1`` counts all of it at once (a large backlog then keeps its engines until
    it drains, at the expense of the other tiers); larger values let the tiers' new work
    decide, so that a burst in one tier cannot starve the others. A tier with a backlog
    always has demand, so it keeps at least one engine.
    """
    if backlog_rounds < 1:
        raise ValueError(f"backlog_rounds: must be >= 1, got {backlog_rounds}")
    a = np.asarray(arrived_ns, dtype=np.float64)
    q = np.asarray(queued_ns, dtype=np.float64)
    out: FloatArray = a + q / backlog_rounds
    return out


def ideal_shares(n_engines: int, demand_ns: npt.ArrayLike) -> FloatArray:
    """Fractional engines per tier, shape (T,), with the at-least-one pinning of rule 1.

    ``demand_ns`` has shape (T,), non-negative quota demand of the previous round (ns).
    Sums to ``n_engines`` when some tier has demand, else all zeros.
    """
    d = np.asarray(demand_ns, dtype=np.float64)
    if d.ndim != 1:
        raise ValueError("demand_ns: must be one-dimensional")
    if np.any(~np.isfinite(d)) or np.any(d < 0):
        raise ValueError("demand_ns: must be finite and >= 0")
    if n_engines < 0:
        raise ValueError(f"n_engines: must be >= 0, got {n_engines}")
    shares = np.zeros_like(d)
    active = d > 0
    if n_engines == 0 or not active.any():
        return shares
    if n_engines < int(active.sum()):
        # Engines do not suffice: one engine each for the tiers of largest demand.
        order = sorted(np.flatnonzero(active).tolist(), key=lambda i: (-d[i], i))
        shares[order[:n_engines]] = 1.0
        return shares
    pinned = np.zeros_like(active)
    while True:
        free = active & ~pinned
        rest = n_engines - int(pinned.sum())
        total = float(d[free].sum())
        shares = np.where(pinned, 1.0, 0.0)
        if total > 0:
            shares = shares + np.where(free, rest * d / total, 0.0)
        newly = free & (shares < 1.0)
        if not newly.any():
            return shares
        pinned = pinned | newly


def largest_remainder(n_engines: int, demand_ns: npt.ArrayLike) -> IntArray:
    """Integer engines per tier, shape (T,), by rules 1-2 (no hysteresis, no history).

    Sums to ``n_engines`` when some tier has demand, else all zeros.
    """
    d = np.asarray(demand_ns, dtype=np.float64)
    shares = ideal_shares(n_engines, d)
    counts = np.floor(shares).astype(np.int64)
    left = n_engines - int(counts.sum()) if shares.sum() > 0 else 0
    if left > 0:
        rem = shares - counts
        eligible = d > 0
        order = sorted(
            (int(i) for i in np.flatnonzero(eligible)),
            key=lambda i: (-rem[i], -d[i], i),
        )
        for i in order[:left]:
            counts[i] += 1
    return counts


def _feasible(counts: IntArray, n_engines: int, demand: FloatArray) -> bool:
    if counts.shape != demand.shape or int(counts.sum()) != n_engines or np.any(counts < 0):
        return False
    active = demand > 0
    return not (n_engines >= int(active.sum()) and np.any(active & (counts < 1)))


def allocate(
    n_engines: int,
    demand_ns: npt.ArrayLike,
    previous: npt.ArrayLike | None = None,
    hysteresis: float = DEFAULT_HYSTERESIS,
) -> IntArray:
    """Engines per tier for the next round, shape (T,), summing to ``n_engines``.

    ``demand_ns`` (T,) is each tier's quota demand in the previous round (ns);
    ``previous`` (T,) the current split (engines) or None; ``hysteresis`` in engines.
    """
    if hysteresis < 0:
        raise ValueError(f"hysteresis: must be >= 0, got {hysteresis}")
    d = np.asarray(demand_ns, dtype=np.float64)
    prev = None if previous is None else np.asarray(previous, dtype=np.int64)
    if not np.any(d > 0):
        if prev is not None and _feasible(prev, n_engines, d):
            return prev.copy()
        if n_engines <= 0:
            return np.zeros(d.shape, dtype=np.int64)
        return largest_remainder(n_engines, np.ones_like(d))
    # Hysteresis keeps the current split against noise, but never leaves an engine on a
    # tier without demand while another tier has some (work for a tier without engines
    # triggers a redistribution at once, so a rare tier gets one back when it needs it).
    if prev is not None and _feasible(prev, n_engines, d) and not np.any((d <= 0) & (prev > 0)):
        ideal = ideal_shares(n_engines, d)
        if float(np.max(np.abs(prev - ideal))) <= hysteresis:
            return prev.copy()
    return largest_remainder(n_engines, d)


@dataclass(frozen=True, slots=True)
class Assignment:
    """Result of :func:`assign_engines`: engine id -> tier, and how many engines moved."""

    tiers: Mapping[str, int]
    moves: int


def assign_engines(
    engines: Sequence[str],
    previous: Mapping[str, int],
    counts: npt.ArrayLike,
    loads_ns: Mapping[str, int] | None = None,
) -> Assignment:
    """Map engine ids to tiers so that tier ``i`` holds ``counts[i]`` engines, moving few.

    ``engines``: live engine ids (any order; the result does not depend on it);
    ``previous``: last round's engine -> tier (may name lapsed engines, ignored);
    ``counts`` (T,): target engines per tier, summing to ``len(engines)``;
    ``loads_ns``: each engine's outstanding prefill work (ns, summed over its ranks; a
    missing engine counts as 0). It only decides which engines move and where: the
    least-loaded leave an over-full tier, and the emptiest land in the shortest tiers.
    ``moves`` counts engines that had a tier and now have a different one.
    """
    load = {} if loads_ns is None else loads_ns
    want = [int(x) for x in np.asarray(counts, dtype=np.int64)]
    live = sorted(set(engines))
    if sum(want) != len(live) or any(x < 0 for x in want):
        raise ValueError(f"counts: must be >= 0 and sum to {len(live)} engines, got {want}")
    n_tiers = len(want)
    members: list[list[str]] = [[] for _ in range(n_tiers)]
    fresh: list[str] = []
    for e in live:
        t = previous.get(e)
        if t is not None and 0 <= t < n_tiers:
            members[t].append(e)
        else:
            fresh.append(e)
    pool: list[str] = []
    for t in range(n_tiers):
        excess = len(members[t]) - want[t]
        if excess > 0:
            # Least outstanding work leaves first; ties: highest ids first.
            order = sorted(
                reversed(members[t]), key=lambda e: max(0, int(load.get(e, 0)))
            )
            leave = order[:excess]
            pool.extend(leave)
            gone = set(leave)
            members[t] = [e for e in members[t] if e not in gone]
    pool.extend(fresh)
    # Emptiest first (stable: ties keep the order above), filling the shortest tiers first.
    pool.sort(key=lambda e: max(0, int(load.get(e, 0))))
    out: dict[str, int] = {}
    for t in range(n_tiers):
        for e in members[t]:
            out[e] = t
    it = iter(pool)
    for t in range(n_tiers):
        for _ in range(want[t] - len(members[t])):
            out[next(it)] = t
    moves = sum(1 for e, t in out.items() if e in previous and previous[e] != t)
    return Assignment(tiers=out, moves=moves)
