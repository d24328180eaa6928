"""Push-router baselines, and count-based rules where the core has no such policy.

The simulator prefers the core's own modules: decode ``round_robin``, ``least_requests``
and ``power_of_two`` and VE ``power_of_two`` come from ``fulcrum.core``. This module
covers what the core does not register -- the prefill rank choice of a conventional
push router (no tiers, no pull), decode ``random``, and VE ``round_robin``, ``random``
and ``least_requests`` -- with the textbook rules over a per-target array ``counts``
(shape (n,): requests or images in flight, or outstanding predicted ns):

* ``round_robin``: target ``cursor % n``; the cursor advances by one.
* ``random``: uniform target (one ``rng.integers(n)`` draw).
* ``least_requests``: fewest requests; ties to the lowest index.
* ``power_of_two``: two distinct uniform targets, the smaller count wins (ties: first).
* ``least_work``: least outstanding predicted prefill work (ns), as SGLang's token-based
  and llm-d's load scorers do (prefill only; elsewhere it means ``least_requests``).
* ``one_engine``: everything to the first engine's ranks (least requests among them) --
  a deliberately bad policy that idles every other engine, kept to check that a
  yardstick does not reward it (prefill only; elsewhere ``least_requests``).

Prefix-aware push routers (per-engine prefix caches, :data:`PREFIX_NAMES`; prefill only,
elsewhere they mean ``least_requests``) keep the same approximate prefix index the
daemon keeps (:class:`fulcrum.core.prefill.affinity.PrefixIndex`: the blocks of what the
router sent each engine, LRU at the engine's cache capacity) and choose an *engine*, then
its least-work rank:

* ``prefix_load``: the highest ``3 x prefix + 2 x load`` score, ``prefix`` = the request's
  leading blocks the engine holds / its blocks, ``load`` = 1 - the engine's outstanding
  work / the most loaded engine's (the way llm-d's scheduler sums a weighted prefix-cache
  scorer and a load scorer; ties to the lowest index);
* ``cache_aware``: SGLang's cache-aware rule -- when the load is imbalanced (most minus
  least outstanding work above ``8 x step budget`` and most above 1.5 x least), the
  least-work engine; else the engine with the longest held prefix when it covers at least
  half the request's blocks; else the least-work engine.

A push router does not see the engines' queues. :class:`PushRouter` gives it what a real
one has: its own assignments plus load reports (per DP rank: requests and outstanding
predicted ns) that each engine sends after every step and that reach the router
``staleness_ns`` later (default 50 ms). A pulling engine needs no report: it knows its
own queue exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from fulcrum.core.prefill.affinity import PrefixIndex
from fulcrum.core.registry import Registry

ROUND_ROBIN: Final = "round_robin"
RANDOM: Final = "random"
LEAST_REQUESTS: Final = "least_requests"
POWER_OF_TWO: Final = "power_of_two"
LEAST_WORK: Final = "least_work"
ONE_ENGINE: Final = "one_engine"
PREFIX_LOAD: Final = "prefix_load"
CACHE_AWARE: Final = "cache_aware"
PREFIX_NAMES: Final = (PREFIX_LOAD, CACHE_AWARE)
"""Prefix-aware push routers (need block hashes and per-engine caches)."""
NAMES: Final = (ROUND_ROBIN, RANDOM, LEAST_REQUESTS, POWER_OF_TWO, LEAST_WORK, ONE_ENGINE,
                *PREFIX_NAMES)
"""Every baseline name (prefill push routers; the order of :data:`BASELINES`)."""

PREFIX_WEIGHT: Final = 3.0
LOAD_WEIGHT: Final = 2.0
IMBALANCE_STEPS: Final = 8.0
IMBALANCE_RATIO: Final = 1.5
MATCH_THRESHOLD: Final = 0.5

DEFAULT_STALENESS_NS: Final = 50_000_000
"""Default age of the load reports a push router sees (ns): 50 ms."""


Counts = npt.NDArray[np.int64] | npt.NDArray[np.float64]
Pick = Callable[[Counts, np.random.Generator, int], tuple[int, int]]


def _round_robin(counts: Counts, rng: np.random.Generator, cursor: int) -> tuple[int, int]:
    n = int(counts.shape[0])
    i = cursor % n
    return i, (i + 1) % n


def _random(counts: Counts, rng: np.random.Generator, cursor: int) -> tuple[int, int]:
    return int(rng.integers(int(counts.shape[0]))), cursor


def _least(counts: Counts, rng: np.random.Generator, cursor: int) -> tuple[int, int]:
    return int(counts.argmin()), cursor


def _power_of_two(counts: Counts, rng: np.random.Generator, cursor: int) -> tuple[int, int]:
    n = int(counts.shape[0])
    if n == 1:
        return 0, cursor
    a = int(rng.integers(n))
    b = int(rng.integers(n - 1))
    if b >= a:
        b += 1
    return (b if counts[b] < counts[a] else a), cursor


@dataclass(frozen=True, slots=True)
class Baseline:
    """One baseline: ``pick(counts, rng, cursor) -> (target, next cursor)`` over a
    per-target array; ``load``: what a push router's view feeds it (``none``: no view,
    ``requests`` in flight, ``work`` outstanding ns); ``first_engine``: only the first
    engine's ranks; ``prefix``: a prefix-aware router (engine by :func:`_prefix_load` or
    :func:`_cache_aware`, then its least-work rank)."""

    pick: Pick
    load: str = "requests"
    first_engine: bool = False
    prefix: Callable[[npt.NDArray[np.float64], list[int], int, float, bool], int] | None = None


def _prefix_load(work: npt.NDArray[np.float64], match: list[int], n: int,
                 step_ns: float, has_blocks: bool) -> int:
    """llm-d-like: the highest ``3 x prefix + 2 x load`` score (ties: lowest index)."""
    engines = len(match)
    top = float(work.max())
    load = 1.0 - work / top if top > 0 else np.ones(engines)
    score = [PREFIX_WEIGHT * match[e] / n + LOAD_WEIGHT * float(load[e])
             for e in range(engines)]
    return max(range(engines), key=lambda x: (score[x], -x))


def _cache_aware(work: npt.NDArray[np.float64], match: list[int], n: int,
                 step_ns: float, has_blocks: bool) -> int:
    """SGLang-like: least work when imbalanced, else the longest held prefix when it
    covers half the blocks, else least work."""
    hi, lo = float(work.max()), float(work.min())
    least = int(work.argmin())
    best = max(range(len(match)), key=lambda x: (match[x], -work[x], -x))
    if hi - lo > IMBALANCE_STEPS * step_ns and hi > IMBALANCE_RATIO * lo:
        return least
    if has_blocks and match[best] / n >= MATCH_THRESHOLD:
        return best
    return least


def _constant(b: Baseline) -> Callable[[object], Baseline]:
    def make(params: object) -> Baseline:
        return b
    return make


#: Every baseline, by name (also the policy-set names of the push routers).
BASELINES: Registry[Baseline] = Registry("sim.baselines")
for _name, _b in (
    (ROUND_ROBIN, Baseline(_round_robin, load="none")),
    (RANDOM, Baseline(_random, load="none")),
    (LEAST_REQUESTS, Baseline(_least)),
    (POWER_OF_TWO, Baseline(_power_of_two)),
    (LEAST_WORK, Baseline(_least, load="work")),
    (ONE_ENGINE, Baseline(_least, first_engine=True)),
    (PREFIX_LOAD, Baseline(_least, prefix=_prefix_load)),
    (CACHE_AWARE, Baseline(_least, prefix=_cache_aware)),
):
    BASELINES.register(_name, _constant(_b))

_BUILT: dict[str, Baseline] = {}


def baseline(name: str) -> Baseline:
    """The baseline called ``name`` (ValueError naming the known ones otherwise)."""
    b = _BUILT.get(name)
    if b is None:
        b = _BUILT[name] = BASELINES.make(name)
    return b


def choose(name: str, counts: Counts, rng: np.random.Generator,
           cursor: int) -> tuple[int, int]:
    """Target index and next cursor under baseline ``name`` (see module docstring)."""
    if int(counts.shape[0]) == 0:
        raise ValueError("counts: need at least one target")
    return baseline(name).pick(counts, rng, cursor)


class PushRouter:
    """A push router's rank choice over ``engines x ranks`` DP ranks, with stale reports.

    The router's view of a rank is the rank's last report that is at least
    ``staleness_ns`` old (requests, outstanding ns) plus what the router itself sent to
    the rank since that report was taken. Reports are given by :meth:`report` as the
    engines take them; :meth:`route` returns the global rank index ``e * ranks + r``.
    """

    __slots__ = (
        "_cursor",
        "_pending",
        "_reports",
        "_rng",
        "_rule",
        "_seen",
        "n_ranks",
        "name",
        "ranks",
        "staleness_ns",
    )

    def __init__(
        self, name: str, engines: int, ranks: int, rng: np.random.Generator,
        staleness_ns: int = DEFAULT_STALENESS_NS,
    ) -> None:
        if name not in BASELINES:
            raise ValueError(f"prefill: unknown policy {name!r} (known: {', '.join(NAMES)})")
        if staleness_ns < 0:
            raise ValueError(f"staleness_ns: must be >= 0, got {staleness_ns}")
        self.name = name
        self._rule = baseline(name)
        self.ranks = ranks
        self.n_ranks = engines * ranks
        self.staleness_ns = staleness_ns
        self._rng = rng
        self._cursor = 0
        # Per engine: reports (t, requests per rank, ns per rank) not yet visible, and
        # the one in force; the router's own sends since the report in force.
        self._reports: list[deque[tuple[int, npt.NDArray[np.int64],
                                        npt.NDArray[np.float64]]]] = [
            deque() for _ in range(engines)
        ]
        self._seen: list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.float64]]] = [
            (-1, np.zeros(ranks, dtype=np.int64), np.zeros(ranks)) for _ in range(engines)
        ]
        self._pending: list[deque[tuple[int, int, float]]] = [deque() for _ in range(engines)]

    def report(self, now_ns: int, engine: int, requests: npt.ArrayLike,
               work_ns: npt.ArrayLike) -> None:
        """Engine ``engine`` reports, at ``now_ns``, its ranks' requests and work (ns)."""
        self._reports[engine].append((
            now_ns, np.asarray(requests, dtype=np.int64).copy(),
            np.asarray(work_ns, dtype=np.float64).copy(),
        ))

    def _view(self, now_ns: int, engine: int) -> tuple[npt.NDArray[np.int64],
                                                       npt.NDArray[np.float64]]:
        visible = now_ns - self.staleness_ns
        reps = self._reports[engine]
        while reps and reps[0][0] <= visible:
            self._seen[engine] = reps.popleft()
        t_seen, reqs, work = self._seen[engine]
        reqs = reqs.copy()
        work = work.copy()
        pend = self._pending[engine]
        while pend and pend[0][0] <= t_seen:
            pend.popleft()  # already counted in the report in force
        for _, r, cost in pend:
            reqs[r] += 1
            work[r] += cost
        return reqs, work

    def route(self, now_ns: int, cost_ns: float) -> int:
        """The global DP rank for a request of predicted ``cost_ns`` arriving at ``now_ns``."""
        engines = len(self._reports)
        rule = self._rule
        if rule.load == "none":
            i, self._cursor = rule.pick(np.zeros(self.n_ranks, dtype=np.int64),
                                        self._rng, self._cursor)
        else:
            views = [self._view(now_ns, e) for e in range(engines)]
            if rule.first_engine:
                views = views[:1]
            if rule.load == "work":
                arr: Counts = np.concatenate([w for _, w in views])
            else:
                arr = np.concatenate([q for q, _ in views])
            i, self._cursor = rule.pick(arr, self._rng, self._cursor)
        e, r = divmod(i, self.ranks)
        self._pending[e].append((now_ns, r, float(cost_ns)))
        return i

    def route_prefix(
        self, now_ns: int, index: PrefixIndex, total: int, blocks: Sequence[int],
        cost_ns: Callable[[int, int], int], step_ns: float,
    ) -> tuple[int, int]:
        """Prefix-aware push (``prefix_load`` / ``cache_aware``, module docstring): the
        global DP rank and the predicted cost (ns) on the chosen engine. ``index``: the
        router's own belief of the engines' caches (engine ids ``"0"``, ``"1"``, ...),
        updated here with the request's blocks; ``cost_ns(q, c)``: the cost model;
        ``step_ns``: the step budget (the imbalance threshold's unit)."""
        engines = len(self._reports)
        views = [self._view(now_ns, e) for e in range(engines)]
        work = np.array([float(w.sum()) for _, w in views])
        n = max(1, len(blocks))
        match = [index.match(str(e), blocks) for e in range(engines)]
        engine_rule = self._rule.prefix
        if engine_rule is None:
            raise ValueError(f"prefill: {self.name!r} is not a prefix-aware router")
        e = engine_rule(work, match, n, step_ns, bool(blocks))
        r = int(views[e][1].argmin())
        c = index.cached_tokens(match[e], total)
        cost = cost_ns(total - c, c)
        index.record(str(e), blocks)
        self._pending[e].append((now_ns, r, float(cost)))
        return e * self.ranks + r, cost
