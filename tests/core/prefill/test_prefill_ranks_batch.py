"""Least-loaded rank assignment and FIFO batch selection within quota."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import ENGINE_POLICIES, RANK_POLICIES, lookup
from fulcrum.core.prefill.batch import BatchFill, select_batch
from fulcrum.core.prefill.items import Offer
from fulcrum.core.prefill.ranks import assign_ranks
from fulcrum.core.prefill.rules.puller import EmptiestRank, MostQuota


@pytest.mark.parametrize(
    ("loads", "costs", "ranks", "after"),
    [
        ([0, 0, 0, 0], [5, 5, 5, 5], [0, 1, 2, 3], [5, 5, 5, 5]),
        ([10, 0, 3, 0], [4, 4, 4], [1, 3, 2], [10, 4, 7, 4]),
        ([7, 7], [1, 1, 1], [0, 1, 0], [9, 8]),  # ties: lowest rank index
        ([5], [1, 2], [0, 0], [8]),
        ([1, 2, 3], [], [], [1, 2, 3]),
    ],
)
def test_assign_ranks_table(
    loads: list[int], costs: list[int], ranks: list[int], after: list[int]
) -> None:
    plan = assign_ranks(loads, costs)
    assert list(plan.ranks) == ranks
    assert list(plan.loads_ns) == after


def test_assign_ranks_rejects() -> None:
    with pytest.raises(ValueError, match="rank_loads_ns"):
        assign_ranks([], [1])
    with pytest.raises(ValueError, match="rank_loads_ns"):
        assign_ranks([-1], [1])
    with pytest.raises(ValueError, match="costs_ns"):
        assign_ranks([0], [-1])
    assert lookup(RANK_POLICIES, "least_loaded") is assign_ranks


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 10**10), min_size=1, max_size=64),
    st.lists(st.integers(0, 10**10), max_size=50),
)
def test_assign_ranks_is_greedy_least_loaded(loads: list[int], costs: list[int]) -> None:
    plan = assign_ranks(loads, costs)
    cur = list(loads)
    for cost, r in zip(costs, plan.ranks, strict=True):
        low = min(cur)
        assert cur[r] == low and r == cur.index(low)  # least loaded, lowest index on ties
        cur[r] += cost
    assert list(plan.loads_ns) == cur
    assert sum(plan.loads_ns) == sum(loads) + sum(costs)


@pytest.mark.parametrize(
    ("costs", "remaining", "cap", "idle", "max_requests", "n"),
    [
        ([3, 3, 3], 10, 100, False, None, 3),
        ([3, 3, 3], 8, 100, False, None, 2),
        ([3, 3, 3], 100, 7, False, None, 2),  # tier cap binds
        ([3, 9, 1], 10, 100, False, None, 1),  # FIFO: the 1 behind the 9 does not jump
        ([20, 1], 10, 100, False, None, 0),  # head too big, engine busy: wait
        ([20, 1], 10, 100, True, None, 1),  # idle engine serves the oversize head alone
        ([20, 1], 100, 10, True, None, 1),  # larger than the tier cap: alone too
        ([], 10, 10, True, None, 0),
        ([1, 1, 1, 1], 10, 10, False, 2, 2),
        ([0, 0], 0, 0, False, None, 2),
    ],
)
def test_select_batch_table(
    costs: list[int], remaining: int, cap: int, idle: bool, max_requests: int | None, n: int
) -> None:
    assert select_batch(costs, remaining, cap, idle=idle, max_requests=max_requests) == n


def test_select_batch_rejects_and_registry() -> None:
    with pytest.raises(ValueError, match="max_requests"):
        select_batch([1], 1, 1, idle=True, max_requests=0)
    assert lookup(ENGINE_POLICIES, "fifo_quota") is select_batch


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 10**9), max_size=30),
    st.integers(0, 10**10),
    st.integers(0, 10**10),
    st.booleans(),
)
def test_select_batch_invariants(costs: list[int], remaining: int, cap: int, idle: bool) -> None:
    n = select_batch(iter(costs), remaining, cap, idle=idle)
    limit = min(remaining, cap)
    assert 0 <= n <= len(costs)
    if n >= 2 or (n == 1 and not idle):
        assert sum(costs[:n]) <= limit  # within quota and cap
    if n < len(costs):
        assert sum(costs[: n + 1]) > limit  # longest prefix
    if costs and idle:
        assert n >= 1  # never starved on an idle engine


@pytest.mark.parametrize(
    ("remaining", "index"),
    [([5], 0), ([1, 9, 3], 1), ([4, 9, 9], 1), ([0, 0], 0)],
)
def test_most_quota_prefers_the_most_remaining_quota_then_the_first(
        remaining: list[int], index: int) -> None:
    rule = MostQuota()
    offers = [Offer(f"e{i}", r, (0,)) for i, r in enumerate(remaining)]
    assert min(range(len(offers)), key=lambda i: rule.key(offers[i], i)) == index


@pytest.mark.parametrize(
    ("loads", "remaining", "index"),
    [([[5], [0]], [9, 1], 1), ([[0], [0]], [1, 9], 1), ([[3, 0], [0, 1]], [5, 5], 0)],
)
def test_emptiest_rank_prefers_the_emptiest_rank_then_quota_then_the_first(
        loads: list[list[int]], remaining: list[int], index: int) -> None:
    rule = EmptiestRank()
    offers = [Offer(f"e{i}", r, tuple(x)) for i, (x, r) in enumerate(zip(loads, remaining,
                                                                         strict=True))]
    assert min(range(len(offers)), key=lambda i: rule.key(offers[i], i)) == index


@given(
    st.lists(st.integers(0, 50), max_size=12),
    st.integers(0, 200),
    st.integers(0, 200),
    st.booleans(),
    st.one_of(st.none(), st.integers(1, 6)),
)
def test_batch_fill_counts_as_select_batch(
    costs: list[int], remaining: int, cap: int, idle: bool, max_requests: int | None
) -> None:
    """The pull's incremental quota step takes exactly the prefix select_batch counts."""
    fill = BatchFill(remaining, cap, idle=idle, max_requests=max_requests)
    for c in costs:
        if not fill.offer(c) or fill.closed:
            break
    assert fill.n == select_batch(costs, remaining, cap, idle=idle, max_requests=max_requests)
