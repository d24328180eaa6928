"""Pure lease bookkeeping with the balancer: every request ends exactly once (acknowledged
once, by the engine holding its lease), is never in two places, and the quota adds up."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued
from fulcrum.core.prefill.leases import LeaseTable, requeue_order

S = 1_000_000_000
ENGINES = ("a", "b", "c")
LEASE = 10

ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from((1_000, 20_000, 100_000))),
        st.tuples(st.just("take"), st.sampled_from(ENGINES), st.integers(0, 40)),
        st.tuples(st.just("ack"), st.sampled_from(ENGINES), st.integers(0, 7)),
        st.tuples(st.just("tick"), st.integers(1, 12)),
        st.tuples(st.just("leave"), st.sampled_from(ENGINES)),
        st.tuples(st.just("join"), st.sampled_from(ENGINES)),
    ),
    max_size=120,
)


def _balancer() -> PrefillBalancer:
    return PrefillBalancer(BalancerConfig(
        bounds=(16_384, 65_536), batch_cap_ns=(8 * S, 32 * S, 128 * S),
        backlog_rounds=4.0, hysteresis=0.5, max_batch_requests=8,
    ))


@settings(max_examples=200, deadline=None)
@given(ops)
def test_every_request_ends_exactly_once(script: list[tuple[object, ...]]) -> None:
    bal = _balancer()
    leases = LeaseTable(bal.n_tiers)
    now = 0
    items: dict[str, Queued] = {}
    done: dict[str, str] = {}  # request -> the engine whose acknowledgement was accepted
    handed: dict[str, list[str]] = {}  # request -> engines it was handed to
    live = set(ENGINES[:2])
    for e in sorted(live):
        bal.add_engine(e, 2)
    for op in script:
        kind = op[0]
        if kind == "submit":
            rid = f"r{len(items)}"
            total = int(op[1])  # type: ignore[call-overload]
            it = Queued(rid, total, 0, bal.tier_of(total), total * 1000, now)
            items[rid] = it
            bal.enqueue(it)
        elif kind == "take" and op[1] in live:
            eng = str(op[1])
            taken = bal.take(eng, int(op[2]) * S // 4, [0, 0])  # type: ignore[call-overload]
            leases.lease(eng, taken.items, taken.ranks, now + LEASE)
            for it in taken.items:
                handed.setdefault(it.request_id, []).append(eng)
        elif kind == "ack":
            eng = str(op[1])
            mine = [r for r, h in handed.items() if h[-1] == eng]
            pick = [r for i, r in enumerate(mine) if (int(op[2]) >> (i % 3)) & 1 or i > 2]
            res = leases.ack(eng, pick, now)
            for lease in res.accepted:
                assert lease.engine_id == eng
                assert lease.request_id not in done, "acknowledged twice"
                done[lease.request_id] = eng
            for rid in res.rejected:  # refused: not (any more) leased to this engine
                lease2 = leases.get(rid)
                assert lease2 is None or lease2.engine_id != eng or now >= lease2.deadline_ns
        elif kind == "tick":
            now += int(op[1])  # type: ignore[call-overload]
            bal.requeue_front(requeue_order(leases.expired(now)))
        elif kind == "leave" and op[1] in live and len(live) > 1:
            live.discard(str(op[1]))
            bal.remove_engine(str(op[1]))
            bal.requeue_front(requeue_order(leases.drop_engine(str(op[1]))))
        elif kind == "join" and op[1] not in live:
            live.add(str(op[1]))
            bal.add_engine(str(op[1]), 2)
        # Invariants after every step: one place per request, quota adds up.
        queued = {it.request_id for t in range(bal.n_tiers) for it in bal.queued(t)}
        leased = {r for r in items if r in leases}
        assert not queued & leased and not queued & set(done) and not leased & set(done)
        assert queued | leased | set(done) == set(items)
        for t in range(bal.n_tiers):
            assert bal.queued_ns(t) == sum(it.cost_ns for it in bal.queued(t))
            assert leases.leased_ns[t] == sum(
                items[r].cost_ns for r in leased if items[r].tier == t
            )
    # Whatever is done was acknowledged by the engine it was last handed to.
    for rid, eng in done.items():
        assert handed[rid][-1] == eng


def test_late_ack_after_expiry_is_refused_and_requeued_first() -> None:
    bal = _balancer()
    leases = LeaseTable(bal.n_tiers)
    bal.add_engine("a", 1)
    for i in range(3):
        bal.enqueue(Queued(f"r{i}", 1000, 0, 0, S // 40, i))
    taken = bal.take("a", S, [0])
    leases.lease("a", taken.items, taken.ranks, 10)
    bal.enqueue(Queued("r3", 1000, 0, 0, S // 40, 5))
    assert leases.ack("a", ["r0"], 3).accepted[0].request_id == "r0"
    back = leases.expired(10)
    assert [x.request_id for x in back] == ["r1", "r2"]
    bal.requeue_front(requeue_order(back))
    assert [it.request_id for it in bal.queued(0)] == ["r1", "r2", "r3"]
    assert bal.queued_ns(0) == 3 * (S // 40)
    res = leases.ack("a", ["r1", "r2", "r1"], 11)
    assert res.accepted == () and res.rejected == ("r1", "r2")
    assert leases.leased_ns == [0, 0, 0]
