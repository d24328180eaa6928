"""Waiting engines kept grouped across dispatches (issue 21): :meth:`Waiting.pick` is
:func:`pick_puller` over the same offers in place order, whatever the queue, the holders,
the engines' loads, and what changed since the last pick (engines moved, offers left,
another puller rule); and it asks only what it needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.balancer import Offer, PrefillBalancer, rules_by_name
from fulcrum.core.prefill.dispatch import pick_puller
from fulcrum.core.prefill.waiting import Waiting
from tests.core.prefill.test_source_view import MS, S, _fleet, _queue

OFFER = st.tuples(
    st.integers(0, 11),  # engine (past the fleet: unknown to the balancer)
    st.sampled_from([0, 400, 9_000]),  # rank loads (ms): idle, under and past the horizon
    st.sampled_from([0, 400, 9_000]),
    st.sampled_from([S, 10**12]),  # remaining quota (ns)
)

cases = st.tuples(
    st.integers(2, 10),
    st.lists(st.integers(0, 4), min_size=4, max_size=4).map(lambda d: [x * S for x in d]),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3_000), st.integers(0, 1),
                       st.integers(0, 12), st.integers(1, 300)), max_size=30),
    st.lists(OFFER, max_size=16),
    st.one_of(st.none(), st.integers(0, 12_000)),
    st.lists(st.integers(0, 4), min_size=4, max_size=4).map(lambda d: [x * S for x in d]),
    st.sets(st.integers(0, 15)),
    st.booleans(),
    st.sampled_from([1, 3, 32]),  # affinity.scan: small, so windows run past the view
    st.lists(st.tuples(st.integers(0, 9), st.sampled_from([0, 50, 500])), max_size=4),
    st.one_of(st.none(), st.integers(0, 9)),  # an engine that leaves before the 2nd pick
)


def _flat(bal: PrefillBalancer, offers: dict[tuple[str, int], Offer], tier: int,
          now: int | None) -> tuple[str, int] | None:
    places = sorted(offers)
    i = pick_puller(bal, tier, [offers[p] for p in places], now)
    return None if i < 0 else places[i]


def _priced(run: Callable[[], object]) -> tuple[object, list[tuple[bool, ...]]]:
    """``run()``, and which engines (e0..e11) each pricer it built counts as pulling."""
    seen = []

    class Recording(aff_order.Pricer):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            seen.append(args[4])

    with mock.patch.object(aff_order, "Pricer", Recording):
        got = run()
    return got, [tuple(p(f"e{i}") for i in range(12)) for p in seen]


def _check(bal: PrefillBalancer, waiting: Waiting, offers: dict[tuple[str, int], Offer],
           now: int | None) -> None:
    for tier in range(bal.n_tiers):
        grouped = _priced(lambda: waiting.pick(bal, tier, now))  # noqa: B023
        assert grouped == _priced(lambda: _flat(bal, offers, tier, now))  # noqa: B023


T = 10**12  # ns: all the quota a step could want

#: Found by a random search: the third tier-0 request the window reads past what the
#: source step reads (scan 3), a priority-0 one held by e3, goes to e3 before anyone
#: takes the head; a pick that asked only the source step's holders chose e4.
DEEP = (
    8, [3 * S, 0, 2 * S, 4 * S],
    [(2, 1952, 1, 9, 112), (1, 1154, 0, 12, 49), (2, 2181, 0, 4, 51), (0, 2801, 1, 7, 287),
     (0, 1449, 1, 5, 105), (3, 1813, 1, 0, 281), (0, 382, 1, 11, 1), (3, 1364, 0, 11, 167),
     (0, 782, 0, 3, 73), (3, 373, 0, 5, 261), (3, 446, 1, 8, 150), (0, 2242, 1, 8, 105)],
    [(1, 400, 9000, T), (3, 0, 0, T), (2, 9000, 9000, S), (4, 0, 0, T), (10, 0, 0, S),
     (1, 9000, 9000, T), (4, 0, 9000, S), (9, 9000, 400, T), (7, 9000, 9000, T),
     (11, 0, 400, T), (9, 400, 9000, S), (10, 0, 0, T), (0, 0, 9000, T), (3, 0, 400, T)],
    9_882, [3 * S, 0, 2 * S, 4 * S], set(), False, 3, [], None)


@settings(max_examples=200, deadline=None, derandomize=True)
@example(DEEP)
@given(cases)
def test_a_pick_over_the_waiting_set_is_pick_puller_s(case) -> None:  # type: ignore[no-untyped-def]
    engines, demand, reqs, raw, now_ms, demand2, gone, swap, scan, took, leaves = case
    bal, ids = _fleet(engines, demand)
    assert bal.affinity is not None
    bal.affinity = dataclasses.replace(bal.affinity, scan=scan)
    _queue(bal, ids, reqs)
    now = None if now_ms is None else now_ms * MS
    for e, busy_ms in took:  # engines that pulled lately, some still busy at ``now``
        if e < engines:
            bal.take(ids[e], S, [busy_ms * MS, 0], now_ns=max(0, (now_ms or 0) - 40) * MS)
    waiting, offers = Waiting(), {}
    for seq, (e, a, b, quota) in enumerate(raw):
        place = (f"e{e}", seq)  # the daemon's places: engine id, then parking order
        offers[place] = Offer(place[0], quota, [a * MS, b * MS])
        waiting.add(bal, place, offers[place])
    _check(bal, waiting, offers, now)
    # Engines move, some offers leave, maybe another puller rule: the next pick regroups.
    bal.last_demand_ns = [float(x) for x in demand2]
    bal.redistribute("join")
    if leaves is not None and leaves < engines and engines > 2:
        bal.remove_engine(ids[leaves])  # its offers still wait: unknown now, no tier
    for place in sorted(offers):
        if place[1] in gone:
            waiting.discard(place)
            del offers[place]
    if swap:
        bal.reconfigure(dataclasses.replace(bal.config, rules=rules_by_name("published")))
    assert len(waiting) == len(offers)
    _check(bal, waiting, offers, now)


def test_a_place_waits_once() -> None:
    bal, _ = _fleet(2, [S, 0, 0, 0])
    waiting = Waiting()
    waiting.add(bal, ("e0", 0), Offer("e0", S, [0, 0]))
    with pytest.raises(ValueError, match="place"):
        waiting.add(bal, ("e0", 0), Offer("e0", S, [0, 0]))
    waiting.discard(("e0", 0))
    waiting.discard(("e0", 0))  # already gone: nothing
    assert ("e0", 0) not in waiting and len(waiting) == 0


def test_plain_engines_are_asked_once_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # 200 idle engines holding nothing, one short request queued: one source answer
    # per own tier and room, and one "can it take?" question, not one per engine.
    bal, ids = _fleet(200, [S, 0, 0, 0])
    _queue(bal, ids, [(0, 0, 0, len(ids), 0)])  # held by nobody
    waiting = Waiting()
    for i, e in enumerate(ids):
        waiting.add(bal, (e, i), Offer(e, 10**12, [0, 0]))
    src = type(bal.config.rules.source)
    sources, takes = [], []
    real_source, real_take = src.source, PrefillBalancer._can_take_item
    monkeypatch.setattr(src, "source", lambda self, *a: sources.append(a) or real_source(
        self, *a))
    monkeypatch.setattr(PrefillBalancer, "_can_take_item",
                        lambda self, *a: takes.append(a) or real_take(self, *a))
    assert waiting.pick(bal, 0, 10 * MS) == ("e0", 0)  # emptiest rank, then first
    assert len(sources) <= bal.n_tiers  # every engine is on tier 0 with room
    assert len(takes) == 1


def _all_waiting(bal: PrefillBalancer, ids: list[str]) -> tuple[Waiting, dict]:  # type: ignore[type-arg]
    waiting, offers = Waiting(), {}
    for i, e in enumerate(ids):
        offers[e, i] = Offer(e, 10**12, [0, 0])
        waiting.add(bal, (e, i), offers[e, i])
    return waiting, offers


def test_a_holder_sent_elsewhere_is_not_taken_with_its_group() -> None:
    # Two engines of the short tier: the first holds 90 of the 100 blocks of the third
    # tier's head, so it helps there; the other, holding nothing, serves its own tier.
    # The short tier's work goes to the other one, though the holder sorts first.
    bal, ids = _fleet(3, [2 * S, 0, S, 0])
    short = sorted(e for e in ids if bal.engine_tier(e) == 0)
    _queue(bal, ids, [(2, 0, 0, ids.index(short[0]), 90), (0, 0, 0, len(ids), 0)])
    waiting, offers = _all_waiting(bal, short)
    assert waiting.pick(bal, 2, 100 * MS) == (short[0], 0)
    assert waiting.pick(bal, 0, 100 * MS) == (short[1], 1) == _flat(bal, offers, 0, 100 * MS)



def test_without_a_window_a_holder_is_asked_alone() -> None:
    # Past the fairness bound (no window): a loaded engine with 100 ms of quota cannot
    # take the 210 ms head it holds nothing of, but the one holding 3 of its 4 blocks
    # (60 ms there) can, though it has the same offer and sorts after.
    bal, ids = _fleet(2, [S, 0, 0, 0])
    _queue(bal, ids, [(0, 0, 0, 1, 3)])
    waiting, offers = Waiting(), {}
    for i, e in enumerate(ids):
        offers[e, i] = Offer(e, 100 * MS, [MS, MS])
        waiting.add(bal, (e, i), offers[e, i])
    assert waiting.pick(bal, 0, None) == (ids[1], 1) == _flat(bal, offers, 0, None)


def test_a_busy_engine_is_asked_alone() -> None:
    # e0 and e2 reported ~0.5 s of work on both ranks; e2 holds 3 of the head's 4 blocks
    # (60 ms there, 210 ms elsewhere). e0 would finish it later than e2 does, so it
    # leaves it to e2; e1, idle, would finish it well before e2, so it takes it, though
    # e0 has the same offer now and sorts first.
    bal, ids = _fleet(3, [S, 0, 0, 0])
    for e in ("e0", "e2"):
        assert not bal.take(e, S, [500 * MS, 500 * MS], now_ns=S).items
    assert set(bal.busy.busy_at(S + 10 * MS)) == {"e0", "e2"}
    _queue(bal, ids, [(0, 1_000, 0, 2, 3)])
    waiting, offers = Waiting(), {}
    for i, e in enumerate(ids[:2]):  # e2 is not waiting
        offers[e, i] = Offer(e, 10**12, [0, 0])
        waiting.add(bal, (e, i), offers[e, i])
    now = S + 10 * MS
    assert waiting.pick(bal, 0, now) == ("e1", 1) == _flat(bal, offers, 0, now)


@pytest.mark.parametrize("busy", [False, True])
def test_the_first_able_in_key_order_takes(busy: bool) -> None:
    # The head is held by nobody, so any idle engine takes it, the first in order: e0.
    # Sorting after it: e2, holding the second request, which the window reads (it is
    # asked alone, and able), and e1, busy or not.
    bal, ids = _fleet(3, [S, 0, 0, 0])
    assert bal.affinity is not None
    bal.affinity = dataclasses.replace(bal.affinity, scan=1)
    if busy:
        assert not bal.take("e1", S, [50 * MS, 50 * MS], now_ns=90 * MS).items
        assert bal.busy.busy_at(100 * MS) == ["e1"]
    _queue(bal, ids, [(0, 0, 0, len(ids), 0), (0, 1, 0, 2, 4)])
    waiting, offers = _all_waiting(bal, ids)
    assert waiting.pick(bal, 0, 100 * MS) == ("e0", 0) == _flat(bal, offers, 0, 100 * MS)


def test_after_a_join_or_a_leave_only_the_engines_that_moved_are_regrouped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fulcrum.core.prefill import waiting as W

    bal, ids = _fleet(64, [S, 0, 0, 0])
    waiting, _ = _all_waiting(bal, ids)
    calls: list[str] = []
    real = W._group
    monkeypatch.setattr(W, "_group", lambda b, o: calls.append(o.engine_id) or real(b, o))
    r = bal.add_engine("new", 2)  # nobody else moves
    assert [m[0] for m in r.moved] == ["new"]
    assert waiting.pick(bal, 0, 10 * MS) is None  # nothing queued
    assert calls == []  # "new" offers nothing yet; no other engine moved
    _queue(bal, ids, [(0, 0, 0, len(ids), 0)])  # one request nobody holds
    assert waiting.pick(bal, 0, 10 * MS) == ("e0", 0)
    moved = bal.remove_engine("e0")  # a leave: e0's offers go to no tier
    assert moved is not None
    assert waiting.pick(bal, 0, 10 * MS) == ("e1", 1)
    assert sorted(calls) == sorted(["e0", *(m[0] for m in moved.moved)])
    bal.reconfigure(bal.config)  # the rules may have changed: every offer is regrouped
    waiting.pick(bal, 0, 10 * MS)
    assert len(calls) == 1 + len(moved.moved) + len(ids)
