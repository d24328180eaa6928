"""Priority bands on an engine's ranks (issue 23): the rank queue order, the work ahead
of a band, and the balancer binding a higher band's request by that work."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.core.cost import DEFAULT_COST_MODEL as MODEL
from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued
from fulcrum.core.prefill.bands import loads_for
from fulcrum.core.prefill.chunks import ChunkPlanner, PrefillTask, band_loads, enqueue_task
from fulcrum.core.prefill.rules import RULE_SETS
from fulcrum.core.tenants import RequestClass, TenantPolicy

S = 1_000_000_000
MS = 1_000_000


def t(rid: str, prio: int = 0, need: int = 1_000, overtaken: int = 0) -> PrefillTask:
    return PrefillTask(rid, 0, need, prio, overtaken)


# (queue before: (id, priority, overtaken)), new (id, priority), max, expected ids
ORDER = [
    ([], ("n", 1), 10_000, ["n"]),
    ([("a", 0, 0), ("b", 0, 0)], ("n", 0), 10_000, ["a", "b", "n"]),  # one band: FIFO
    ([("a", 0, 0), ("b", 0, 0)], ("n", 1), 10_000, ["n", "a", "b"]),  # ahead of lower
    ([("h", 2, 0), ("a", 0, 0)], ("n", 1), 10_000, ["h", "n", "a"]),  # behind higher
    ([("h", 1, 0), ("a", 0, 0)], ("n", 1), 10_000, ["h", "n", "a"]),  # FIFO in its band
    ([("a", 0, 9_500), ("b", 0, 0)], ("n", 1), 10_000, ["a", "n", "b"]),  # a is full
    ([("a", 0, 0), ("b", 0, 9_001)], ("n", 1), 10_000, ["a", "b", "n"]),  # b stops it
    ([("a", -1, 0), ("b", 0, 0)], ("n", 1), 10_000, ["n", "a", "b"]),
]


@pytest.mark.parametrize(("before", "new", "most", "expected"), ORDER)
def test_rank_queue_order(before: list[tuple[str, int, int]], new: tuple[str, int],
                          most: int, expected: list[str]) -> None:
    q = deque(t(r, p, overtaken=o) for r, p, o in before)
    passed = enqueue_task(q, t(*new), most)
    assert [x.request_id for x in q] == expected
    assert passed == len(expected) - 1 - expected.index(new[0])
    moved = {x.request_id: x.overtaken for x in q}
    for r, _, o in before:
        behind = expected.index(r) > expected.index(new[0])
        assert moved[r] == o + (1_000 if behind else 0)


def test_a_split_lower_band_head_pauses_and_resumes() -> None:
    p = ChunkPlanner(1)
    p.add(0, t("low", 0, need=40_000))
    p.step([10 * S])  # the cap (32,768 tokens) splits it
    assert p.queue(0)[0].computed == 32_768
    p.add(0, t("high", 1, need=500))
    assert [x.request_id for x in p.queue(0)] == ["high", "low"]
    plan = p.step([10 * S])
    assert [c.request_id for c in plan.chunks[0]] == ["high", "low"]
    assert plan.chunks[0][1].start == 32_768 and plan.chunks[0][1].last
    assert p.queue(0) == ()


def test_band_loads_and_loads_for() -> None:
    c = MODEL.cost_ns(1_000, 0)
    queues = [deque([t("h", 1), t("a", 0, overtaken=10**9), t("b", 0)]), deque([t("x", 0)]),
              deque()]
    bands = band_loads(queues, MODEL, max_overtaken_tokens=10**9)
    # band 1 on rank 0: h, and a (no longer passable); b is passed
    assert bands == {0: [3 * c, c, 0], 1: [2 * c, 0, 0]}
    assert band_loads([deque(), deque()], MODEL) == {}
    whole = [3 * c, c, 0]
    assert loads_for(1, whole, bands) == [2 * c, 0, 0]
    assert loads_for(0, whole, bands) == whole
    assert loads_for(-3, whole, bands) == whole  # below every band: all of it is ahead
    assert loads_for(5, whole, bands) == [0, 0, 0]  # nothing of its band or higher
    assert loads_for(5, whole, None) is whole  # not reported: the whole load


@given(st.lists(st.tuples(st.integers(-2, 2), st.integers(1, 5_000)), max_size=40),
       st.integers(0, 20_000))
def test_enqueue_keeps_every_task_fifo_per_band_and_bounds_overtaking(
    tasks: list[tuple[int, int]], most: int
) -> None:
    q: deque[PrefillTask] = deque()
    for i, (prio, need) in enumerate(tasks):
        enqueue_task(q, t(str(i), prio, need), most)
    ids = [int(x.request_id) for x in q]
    assert sorted(ids) == list(range(len(tasks)))
    for band in {p for p, _ in tasks}:
        mine = [i for i in ids if tasks[i][0] == band]
        assert mine == sorted(mine)  # FIFO within a band
    assert all(x.overtaken <= most for x in q)
    if len({p for p, _ in tasks}) <= 1:
        assert ids == list(range(len(tasks)))  # one band: plain FIFO, nothing passed
    for x in q:  # what passed a task came later and is of a higher band
        passed = [int(y.request_id) for y in list(q)[:ids.index(int(x.request_id))]
                  if int(y.request_id) > int(x.request_id)]
        assert all(tasks[j][0] > tasks[int(x.request_id)][0] for j in passed)
        assert x.overtaken == sum(tasks[j][1] for j in passed)


def _balancer() -> PrefillBalancer:
    bal = PrefillBalancer(BalancerConfig(
        (16_384, 65_536, 262_144), (8 * S, 32 * S, 128 * S, 512 * S), 8.0, 1.0, 256,
        RULE_SETS["default"], tenants=TenantPolicy()))
    bal.add_engine("e0", 2)
    return bal


def q(rid: str, prio: int, t0: int = 0) -> Queued:
    return Queued(rid, 1_000, 0, 0, 10 * MS, t0, cls=RequestClass("t", prio, None))


def test_a_higher_band_binds_by_the_work_ahead_of_it() -> None:
    full = [2 * S, 3 * S]  # both ranks far past the late-binding horizon (100 ms)
    for bands, expect in [(None, []), ({0: full}, ["hi"]), ({0: full, 1: [0, 0]}, ["hi"]),
                          ({0: full, 1: [2 * S, 3 * S]}, [])]:
        bal = _balancer()
        bal.enqueue(q("hi", 1))
        bal.enqueue(q("lo", 0, 1))
        taken = bal.take("e0", 0, full, now_ns=10, band_loads=bands)
        assert [it.request_id for it in taken.items] == expect, bands
        if expect:
            assert taken.ranks == (0,)  # the rank with less work ahead of band 1
            assert bal.get("lo") is not None  # the late-binding horizon holds for band 0


def test_the_band_pass_is_followed_by_the_usual_pass() -> None:
    bal = _balancer()
    bal.enqueue(q("hi", 1))
    bal.enqueue(q("lo", 0, 1))
    # rank 1 is below the horizon for everyone; band 1 has nothing ahead anywhere
    taken = bal.take("e0", 10 * S, [S, 0], now_ns=10, band_loads={0: [S, 0]})
    assert [it.request_id for it in taken.items] == ["hi", "lo"]
    assert taken.costs_ns == (10 * MS, 10 * MS) and taken.quota_ns == 20 * MS


@pytest.mark.parametrize(("limit", "expect"), [(1, ["hi"]), (2, ["hi", "hi2"]),
                                               (3, ["hi", "hi2", "lo"])])
def test_the_two_passes_together_keep_the_pull_s_request_limit(
    limit: int, expect: list[str]
) -> None:
    bal = _balancer()
    bal.enqueue(q("hi", 1))
    bal.enqueue(q("hi2", 1, 1))
    bal.enqueue(q("lo", 0, 2))
    bal.enqueue(q("lo2", 0, 3))
    # rank 1 is below the horizon for band 0 too; band 1 has nothing ahead
    taken = bal.take("e0", 10 * S, [S, 0], limit=limit, now_ns=10, band_loads={0: [S, 0]})
    assert [it.request_id for it in taken.items] == expect


def test_the_two_passes_together_keep_the_tier_batch_cap() -> None:
    bal = PrefillBalancer(BalancerConfig(
        (16_384, 65_536, 262_144), (25 * MS, 32 * S, 128 * S, 512 * S), 8.0, 1.0, 256,
        RULE_SETS["default"], tenants=TenantPolicy()))
    bal.add_engine("e0", 2)
    for rid, prio, t0 in (("hi", 1, 0), ("hi2", 1, 1), ("lo", 0, 2), ("lo2", 0, 3)):
        bal.enqueue(q(rid, prio, t0))
    taken = bal.take("e0", 10 * S, [S, 0], now_ns=10, band_loads={0: [S, 0]})
    assert taken.quota_ns <= 25 * MS
    assert [it.request_id for it in taken.items] == ["hi", "hi2"]


@given(
    items=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 400)), min_size=1,
                   max_size=30),
    loads=st.lists(st.integers(0, 3 * S), min_size=2, max_size=2),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6),
    limit=st.one_of(st.none(), st.integers(1, 6)),
    remaining=st.integers(0, 5 * S),
)
def test_a_pull_with_band_loads_keeps_its_bounds(
    items: list[tuple[int, int]], loads: list[int], fractions: list[float],
    limit: int | None, remaining: int,
) -> None:
    cap = 2 * S
    bal = PrefillBalancer(BalancerConfig(
        (16_384, 65_536, 262_144), (cap, 32 * S, 128 * S, 512 * S), 8.0, 1.0, 8,
        RULE_SETS["default"], tenants=TenantPolicy()))
    bal.add_engine("e0", 2)
    for i, (prio, ms) in enumerate(items):
        bal.enqueue(Queued(f"r{i}", 1_000, 0, 0, ms * MS, i, cls=RequestClass("t", prio, None)))
    # band loads as an engine reports them: the work of that band or higher, so each
    # band's row is at most the one below it, and band 0's is the whole load
    b1 = [int(x * f) for x, f in zip(loads, fractions[:2], strict=True)]
    b2 = [int(x * f) for x, f in zip(b1, fractions[2:4], strict=True)]
    bands = {0: loads, 1: b1, 2: b2}
    before = {f"r{i}" for i in range(len(items))}
    taken = bal.take("e0", remaining, loads, limit=limit, now_ns=len(items), band_loads=bands)
    ids = [it.request_id for it in taken.items]
    assert len(ids) == len(set(ids)) and set(ids) <= before
    assert all(bal.get(r) is None for r in ids)  # taken once, out of the queue
    assert len(ids) <= min(limit or 8, 8)
    assert len(taken.ranks) == len(ids) == len(taken.costs_ns)
    assert taken.quota_ns == sum(taken.costs_ns)
    if len(ids) > 1:
        assert taken.quota_ns <= cap  # one oversize request alone is the only exception
    first = taken.items[:taken.banded]
    if first:
        assert all(it.cls.priority >= first[0].cls.priority for it in first)
