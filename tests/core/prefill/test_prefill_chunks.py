"""Engine-side chunk planner: MIN budget, closed-form chunk sizes, FIFO, no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.client.planner import ChunkPlanner as ClientPlanner
from fulcrum.core.cost import DEFAULT_COST_MODEL, DEFAULT_STEP_BUDGET_NS, CostModel
from fulcrum.core.prefill import CHUNK_POLICIES, lookup
from fulcrum.core.prefill.chunks import ChunkPlanner, PrefillTask, commit, plan_step

M = DEFAULT_COST_MODEL
B = DEFAULT_STEP_BUDGET_NS


def test_client_reexport() -> None:
    assert ClientPlanner is ChunkPlanner
    assert lookup(CHUNK_POLICIES, "fifo_min_budget") is plan_step


def test_worked_example_one_chunk() -> None:
    planner = ChunkPlanner(4)
    planner.add(2, PrefillTask("agent-turn-3", computed=96_896, total=100_000))
    plan = planner.step([B] * 4)
    assert [len(c) for c in plan.chunks] == [0, 0, 1, 0]
    (chunk,) = plan.chunks[2]
    assert (chunk.start, chunk.tokens, chunk.last) == (96_896, 3104, True)
    assert plan.cost_ns[2] == pytest.approx(M.cost(3104, 96_896))
    assert planner.pending_tokens() == (0, 0, 0, 0)


def test_worked_example_split_when_budget_mostly_used() -> None:
    planner = ChunkPlanner(1)
    planner.add(0, PrefillTask("fresh-8k", computed=0, total=8192))
    planner.add(0, PrefillTask("agent-turn-3", computed=96_896, total=100_000))
    first = planner.step([B])
    fresh, part = first.chunks[0]
    assert (fresh.request_id, fresh.tokens, fresh.last) == ("fresh-8k", 8192, True)
    assert part.request_id == "agent-turn-3" and 0 < part.tokens < 3104 and not part.last
    assert first.cost_ns[0] <= B
    second = planner.step([B])
    (rest,) = second.chunks[0]
    assert rest.start == 96_896 + part.tokens
    assert part.tokens + rest.tokens == 3104 and rest.last


def test_min_budget_across_ranks() -> None:
    queues = [[PrefillTask(f"r{r}", 0, 30_000)] for r in range(4)]
    plan = plan_step(queues, [B, B, 0.4 * B, B], M)
    assert plan.budget_ns == 0.4 * B
    sizes = [c[0].tokens for c in plan.chunks]
    assert len(set(sizes)) == 1 and sizes[0] == M.max_tokens(0, 0.4 * B)
    assert plan.step_ns <= 0.4 * B


def test_cap_32768_per_rank_step() -> None:
    free = CostModel(0.0, 1.0, 0.0)
    queues = [[PrefillTask("a", 0, 20_000), PrefillTask("b", 0, 20_000)]]
    plan = plan_step(queues, [1e18], free)
    assert plan.tokens == (32_768,)
    assert [c.tokens for c in plan.chunks[0]] == [20_000, 12_768]


def test_starvation_guard() -> None:
    huge = PrefillTask("huge", computed=10**9, total=10**9 + 2)
    plan = plan_step([[huge]], [B], M)
    assert plan.tokens == (1,)
    plan = plan_step([[huge]], [B], M, force_progress=False)
    assert plan.tokens == (0,) and plan.cost_ns == (0.0,)


def test_commit_rejects_stale_plan() -> None:
    queues = [[PrefillTask("a", 0, 100)]]
    plan = plan_step(queues, [B], M)
    assert commit(queues, plan) == ((),)
    with pytest.raises(ValueError, match="stale"):
        commit([[PrefillTask("b", 0, 100)]], plan)
    planner = ChunkPlanner(1)
    planner.add(0, PrefillTask("b", 0, 100))
    with pytest.raises(ValueError, match="stale"):
        planner.commit(plan)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: PrefillTask("x", -1, 5), "computed"),
        (lambda: PrefillTask("x", 5, 5), "total"),
        (lambda: ChunkPlanner(0), "n_ranks"),
        (lambda: ChunkPlanner(1).add(1, PrefillTask("x", 0, 1)), "rank"),
        (lambda: plan_step([[]], [B, B], M), "budgets_ns"),
        (lambda: plan_step([[]], [B], M, cap=0), "cap"),
    ],
)
def test_rejects(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


tasks = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 200_000), st.integers(1, 60_000)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(
    tasks,
    st.lists(st.floats(0.05 * B, 3 * B), min_size=4, max_size=4),
)
def test_planner_invariants(raw: list[tuple[int, int, int]], budget_scale: list[float]) -> None:
    planner = ChunkPlanner(4, M)
    order: dict[int, list[str]] = {r: [] for r in range(4)}
    expected: dict[str, tuple[int, int]] = {}
    for i, (rank, cached, need) in enumerate(raw):
        rid = f"q{i}"
        planner.add(rank, PrefillTask(rid, cached, cached + need))
        order[rank].append(rid)
        expected[rid] = (cached, cached + need)
    covered: dict[str, int] = {rid: span[0] for rid, span in expected.items()}
    finished: dict[int, list[str]] = {r: [] for r in range(4)}
    steps = 0
    limit = sum(n for _, _, n in raw) + 10  # every non-empty step computes >= 1 token
    while any(planner.pending_tokens()):
        steps += 1
        assert steps <= limit, "starvation"
        budgets = [budget_scale[(steps + r) % 4] for r in range(4)]
        before = planner.pending_tokens()
        plan = planner.step(budgets)
        group = min(budgets)
        for r, chunks in enumerate(plan.chunks):
            assert plan.tokens[r] <= 32_768
            assert sum(c.tokens for c in chunks) == plan.tokens[r]
            if plan.tokens[r] > 1 or len(chunks) > 1:
                assert plan.cost_ns[r] <= group * (1 + 1e-12)  # never over budget
            if before[r] > 0:
                assert plan.tokens[r] >= 1  # progress on every non-empty rank
            for ch in chunks:
                assert ch.start == covered[ch.request_id]  # contiguous, no token twice
                covered[ch.request_id] += ch.tokens
                assert covered[ch.request_id] <= expected[ch.request_id][1]
                assert (covered[ch.request_id] == expected[ch.request_id][1]) == ch.last
                # FIFO: only the head of the remaining order may progress.
                assert order[r][len(finished[r])] == ch.request_id
                if ch.last:
                    finished[r].append(ch.request_id)
    assert all(covered[rid] == span[1] for rid, span in expected.items())  # all exactly once
    assert finished == order


# -- rank budgets: each rank proposes the time of its work, the MIN applies ----------------


def test_rank_budget_table() -> None:
    from fulcrum.core.prefill.chunks import rank_budget

    small = PrefillTask("s", 0, 1_000)  # variable cost 57 ms
    big = PrefillTask("b", 0, 30_000)  # far above the limit
    hi = PrefillTask("h", 0, 1_000, priority=1)
    hi2 = PrefillTask("h2", 0, 1_000, priority=2)
    k = M.k
    cases = [
        ([], 0.0, B),  # an empty rank does not constrain the MIN
        ([small], 0.0, k + 57e6),
        ([small, small], 0.0, k + 2 * 57e6),
        ([small], 0.1 * B, 0.1 * B),  # floor
        ([small], 2 * B, B),  # floor above the limit: the limit
        ([big], 0.0, B),
        ([small, big], 0.0, B),
        # Priority bands: only the head's band counts; lower-band work behind it does not
        # lengthen the step (a higher-band request ends its step when done, issue 23).
        ([hi, big], 0.0, k + 57e6),
        ([hi, hi, small, big], 0.0, k + 2 * 57e6),
        ([hi, big], 0.1 * B, 0.1 * B),  # the floor still holds
        ([small, hi], 0.0, k + 2 * 57e6),  # a lower-band head: everything behind counts
        ([hi2, hi, big], 0.0, k + 57e6),  # band 2 head: band 1 and 0 work behind do not
    ]
    for queue, floor, want in cases:
        assert rank_budget(queue, B, M, floor_ns=floor) == pytest.approx(want)
    with pytest.raises(ValueError, match="limit_ns"):
        rank_budget([small], 0.0, M)


def test_worked_example_one_chunk_with_rank_budgets() -> None:
    # Alone on its engine, the agent turn proposes its own cost (< limit): one chunk.
    planner = ChunkPlanner(4)
    planner.add(2, PrefillTask("agent-turn-3", computed=96_896, total=100_000))
    budgets = planner.budgets(B, floor_ns=0.1 * B)
    assert budgets[2] == pytest.approx(M.cost(3104, 96_896))
    assert [b for i, b in enumerate(budgets) if i != 2] == [B, B, B]
    plan = planner.step(budgets)
    assert [len(c) for c in plan.chunks] == [0, 0, 1, 0]
    assert plan.chunks[2][0].last


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 200_000), st.integers(1, 40_000)), max_size=4),
        min_size=1, max_size=4,
    ),
    st.floats(0.0, 1.0),
)
def test_rank_budgets_level_the_step(
    raw: list[list[tuple[int, int]]], floor_frac: float
) -> None:
    from fulcrum.core.prefill.chunks import rank_budgets

    queues = [
        [PrefillTask(f"r{r}-{i}", c, c + q) for i, (c, q) in enumerate(rq)]
        for r, rq in enumerate(raw)
    ]
    floor = floor_frac * B
    budgets = rank_budgets(queues, B, M, floor_ns=floor)
    assert all(min(floor, B) - 1e-6 <= b <= B for b in budgets)
    plan = plan_step(queues, budgets, M)
    assert plan.budget_ns == min(budgets)
    for q, chunks, cost in zip(queues, plan.chunks, plan.cost_ns, strict=True):
        if not q:
            assert not chunks
            continue
        # Never over the group budget, unless one token is forced (starvation guard).
        assert cost <= plan.budget_ns + 1e-6 or sum(c.tokens for c in chunks) == 1
    # The lightest busy rank (its whole work within the limit and above the floor) drains
    # in this step, unless the chunk cap stops it.
    busy = [i for i, q in enumerate(queues) if q]
    if busy:
        i = min(busy, key=lambda j: budgets[j])
        need = sum(t.need for t in queues[i])
        if budgets[i] < B and budgets[i] > floor and need <= 32_768:
            assert len(plan.chunks[i]) == len(queues[i]) and plan.chunks[i][-1].last


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 1), st.integers(1, 20_000)), max_size=4),
        min_size=1, max_size=4,
    ),
)
def test_a_higher_band_head_ends_its_step(raw: list[list[tuple[int, int]]]) -> None:
    """Two bands on the ranks (higher first, as :func:`enqueue_task` keeps them): the
    step's budget is at most the time of any busy rank's head band (``k`` plus its
    remaining costs, within the limit), whatever lower-band work waits behind it, and the
    rank whose head band needs least finishes that band within the step (unless the
    chunk cap stops it)."""
    from fulcrum.core.prefill.chunks import rank_budgets

    queues = [
        [PrefillTask(f"r{r}-{i}", 0, q, priority=p)
         for i, (p, q) in enumerate(sorted(rq, key=lambda x: -x[0]))]
        for r, rq in enumerate(raw)
    ]
    plan = plan_step(queues, rank_budgets(queues, B, M), M)
    heads = {
        i: [t for t in q if t.priority == q[0].priority] for i, q in enumerate(queues) if q
    }
    if not heads:
        return
    time = {i: min(B, M.k + sum(M.cost(t.need, 0) - M.k for t in h)) for i, h in heads.items()}
    assert all(plan.budget_ns <= t + 1e-6 for t in time.values())
    i = min(time, key=lambda j: time[j])
    if time[i] < B and sum(t.need for t in heads[i]) <= 32_768:
        done = [c.request_id for c in plan.chunks[i] if c.last]
        assert [t.request_id for t in heads[i]] == done[: len(heads[i])]
