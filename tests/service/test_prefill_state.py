"""PrefillState without gRPC: random interleavings of submits (and duplicate re-submits),
cancels, pulls (immediate and long-polling, acknowledged on reply or leased),
acknowledgements (in time, late, partial), lease expiries, rounds, engine joins and
leaves, then a drain. Every request must end exactly once; the submitter learns the one
engine whose acknowledgement was accepted, and no other engine is allowed to run it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import defaultdict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.prefill import PrefillSettings
from fulcrum.config.server import FleetSettings
from fulcrum.core.types import MemberKind, PrefillEngineShape
from fulcrum.errors import DeadlineExceeded, NotFound, Unavailable
from fulcrum.state.fleet import Fleet
from fulcrum.state.prefill import Batch, Delivery, PrefillState

S = 1_000_000_000
SIZES = (2_000, 20_000, 100_000, 300_000, 5_000_000)
ENGINES = ("e0", "e1", "e2")

_submit = st.tuples(st.just("submit"), st.sampled_from(SIZES), st.floats(0.0, 0.99))
_pull = st.tuples(st.just("pull"), st.sampled_from(ENGINES), st.integers(0, 400), st.booleans())
ops = st.lists(
    st.one_of(
        _submit,
        _submit,
        _submit,
        _pull,
        _pull,
        st.tuples(st.just("wait_pull"), st.sampled_from(ENGINES), st.integers(1, 400)),
        st.tuples(st.just("cancel"), st.integers(0, 40)),
        st.tuples(st.just("expire"), st.integers(0, 40)),
        st.tuples(st.just("round")),
        st.tuples(st.just("yield"), st.integers(1, 5)),
        st.tuples(st.just("leave"), st.sampled_from(ENGINES)),
        st.tuples(st.just("join"), st.sampled_from(ENGINES)),
        st.tuples(st.just("lpull"), st.sampled_from(ENGINES[:2]), st.integers(1, 400)),
        st.tuples(st.just("lpull"), st.sampled_from(ENGINES[:2]), st.integers(1, 400)),
        st.tuples(st.just("lpull"), st.sampled_from(ENGINES), st.integers(0, 400)),
        st.tuples(st.just("ack"), st.sampled_from(ENGINES[:2]), st.integers(0, 3)),
        st.tuples(st.just("ack"), st.sampled_from(ENGINES[:2]), st.integers(0, 3)),
        st.tuples(st.just("ack"), st.sampled_from(ENGINES[:2]), st.integers(0, 3)),
        st.tuples(st.just("lease_end"), st.sampled_from(ENGINES)),
        st.tuples(st.just("resubmit"), st.integers(0, 40)),
    ),
    min_size=5,
    max_size=80,
)


async def _scenario(script: list[tuple[Any, ...]]) -> None:
    ticks = itertools.count(1_000_000, 1_000_000)
    clock = lambda: next(ticks)  # noqa: E731 - a monotonic fake clock
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = PrefillState(
        PrefillSettings(round_period_ms=3_600_000, max_queued_per_tier=1000), fleet, clock
    )
    fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
    outcomes: dict[str, list[tuple[str, str]]] = defaultdict(list)
    state.outcome_hooks.append(lambda rid, out, eng: outcomes[rid].append((out, eng)))
    received: dict[str, list[str]] = defaultdict(list)  # engines that may run it
    leased: dict[str, list[str]] = defaultdict(list)  # engine -> ids it holds unacknowledged
    submits: list[tuple[str, asyncio.Task[Delivery]]] = []
    lengths: dict[str, tuple[int, int]] = {}
    dups: list[tuple[str, asyncio.Task[Delivery]]] = []
    pulls: list[tuple[str, asyncio.Task[Batch]]] = []
    for e in ENGINES[:2]:
        fleet.register(e, PrefillEngineShape(dp_ranks=2), clock())

    def record(engine: str, batch: Batch) -> None:
        if batch.lease_ms:
            leased[engine].extend(item.request_id for item in batch.items)
            return
        for item in batch.items:
            received[item.request_id].append(engine)

    accepted_by: dict[str, list[str]] = defaultdict(list)

    def acked(engine: str, ids: list[str], rejected: tuple[str, ...]) -> None:
        for rid in ids:
            if rid not in rejected:
                received[rid].append(engine)
                accepted_by[engine].append(rid)

    for op in script:
        kind = op[0]
        if kind == "submit":
            rid = f"r{len(submits)}"
            total = op[1]
            cached = int(total * op[2])
            task = asyncio.ensure_future(state.submit(rid, total, cached, 3600 * S))
            submits.append((rid, task))
            lengths[rid] = (total, cached)
            await asyncio.sleep(0)
        elif kind == "resubmit" and submits:
            rid, first = submits[op[1] % len(submits)]
            if rid not in state._index or first.done() or first.cancelling():
                continue  # only a re-submit of a request in flight is a duplicate here
            total, cached = lengths[rid]
            dups.append(
                (rid, asyncio.ensure_future(state.submit(rid, total, cached, 3600 * S)))
            )
            await asyncio.sleep(0)
        elif kind == "lpull":
            try:
                batch = await state.pull(op[1], 0, op[2] * S // 4, [0, 0], 0, 0, lease=True)
                record(op[1], batch)
            except NotFound:
                pass
        elif kind == "ack":
            ids = leased.pop(op[1], [])
            hold = 1 if op[2] == 1 else 0  # sometimes hold one back (acknowledged late)
            keep, ids = ids[:hold], ids[hold:]
            if keep:
                leased[op[1]] = keep
            try:
                reply = state.ack(op[1], 0, ids)
                acked(op[1], ids, reply.rejected)
                if op[2] == 3 and accepted_by[op[1]]:
                    # A retried acknowledgement (its reply was lost): still accepted, once.
                    again = state.ack(op[1], 0, accepted_by[op[1]])
                    assert again.rejected == ()
            except NotFound:
                pass
        elif kind == "lease_end":
            state._lease_timer(state.leases.held_by(op[1]))  # as if its lease ran out now
        elif kind == "cancel" and submits:
            submits[op[1] % len(submits)][1].cancel()
        elif kind == "expire" and submits:
            rid = submits[op[1] % len(submits)][0]
            item = state._index.get(rid)
            if item is not None:
                state._expire(item)  # as if its wait ran out now
        elif kind == "pull":
            try:
                batch = await state.pull(op[1], 0, op[2] * S // 4, [] if op[3] else [S, 0], 0, 0)
                record(op[1], batch)
            except NotFound:
                pass
        elif kind == "wait_pull":
            engine = op[1]
            pulls.append(
                (engine, asyncio.ensure_future(state.pull(engine, 0, op[2] * S, [], 3600 * S, 0)))
            )
            await asyncio.sleep(0)
        elif kind == "round":
            state.rebalance(clock(), reason="round")
        elif kind == "yield":
            for _ in range(op[1]):
                await asyncio.sleep(0)
        elif kind == "leave":
            member = fleet.members(MemberKind.PREFILL_ENGINE)
            for m, _seen in member:
                if m.member_id == op[1]:
                    fleet.deregister(m.member_id, m.incarnation, clock())
        elif kind == "join" and op[1] not in {
            m.member_id for m, _ in fleet.members(MemberKind.PREFILL_ENGINE)
        }:
            fleet.register(op[1], PrefillEngineShape(dp_ranks=2), clock())

    # Late acknowledgements of everything still held (refused when the lease ended),
    # then the leases run out; then live engines drain the queues (idle, ample quota).
    for engine, ids in list(leased.items()):
        with contextlib.suppress(NotFound):
            acked(engine, ids, state.ack(engine, 0, ids).rejected)
    state._lease_timer(list(state.leases._by_id.values()))
    assert len(state.leases) == 0 and state.leases.leased_ns == [0] * state.n_tiers
    for _ in range(state.n_tiers + 1):
        await asyncio.sleep(0)
        state.rebalance(clock(), reason="round")
        for m, _seen in fleet.members(MemberKind.PREFILL_ENGINE):
            record(m.member_id, await state.pull(m.member_id, 0, 10**6 * S, [], 0, 0))
    await asyncio.sleep(0)
    state.drain()
    for engine, task in pulls:
        with contextlib.suppress(NotFound):
            record(engine, await task)
    views: dict[str, str] = {}
    for rid, task in submits:
        try:
            delivery = await task
            views[rid] = "delivered:" + delivery.engine_id
        except asyncio.CancelledError:
            views[rid] = "cancelled"
        except DeadlineExceeded:
            views[rid] = "deadline_exceeded"
        except Unavailable:
            views[rid] = "unavailable"
    for rid, task in dups:  # a re-submit learns the request's one outcome
        try:
            delivery = await task
            assert outcomes[rid] == [("delivered", delivery.engine_id)]
            assert views[rid] in ("delivered:" + delivery.engine_id, "cancelled")
        except (DeadlineExceeded, Unavailable):
            assert [o for o, _ in outcomes[rid]] in (["deadline_exceeded"], ["unavailable"])

    assert state.queue_depths() == [0] * state.n_tiers
    assert all(state.waiting_pulls(t) == 0 for t in range(state.n_tiers))
    assert state._woken == [0] * state.n_tiers
    for rid, view in views.items():
        ends = outcomes.get(rid, [])
        if not ends:  # cancelled before it was queued, or refused: no engine
            assert view in ("cancelled", "unavailable") and rid not in received
            continue
        assert len(ends) == 1, f"{rid} ended {ends}"
        outcome, engine = ends[0]
        if outcome == "delivered":
            # Run by one engine only. The same engine may receive it twice: a lease that
            # ran out re-queues the request (documented), that engine pulls it again, and
            # its late acknowledgement of the old lease is accepted as a retry of the same
            # delivery (found by the CI profile's random draws; the derandomized profile
            # never drew lpull -> lease_end -> wait_pull on one engine).
            assert set(received[rid]) == {engine}, f"{rid} received by {received[rid]}"
            assert view in ("delivered:" + engine, "cancelled")
        else:
            assert rid not in received
            assert view in (outcome, "cancelled")  # a cancel may race the server's ending
    assert set(received) <= set(views)


def test_lease_scenarios_by_hand() -> None:
    """Leased pulls acknowledged, re-acknowledged (a lost reply), late after expiry,
    by an engine that left: each request still ends once, on the engine that runs it."""
    for script in (
        [("submit", 2000, 0.0), ("lpull", "e0", 400), ("ack", "e0", 3)],
        [("submit", 2000, 0.0), ("lpull", "e0", 400), ("lease_end", "e0"),
         ("lpull", "e1", 400), ("ack", "e0", 0), ("ack", "e1", 3)],
        [("submit", 2000, 0.0), ("submit", 2000, 0.5), ("lpull", "e0", 400),
         ("leave", "e0"), ("lpull", "e1", 400), ("ack", "e1", 1), ("resubmit", 0)],
        [("submit", 20_000, 0.0), ("lpull", "e1", 400), ("cancel", 0), ("ack", "e1", 0)],
    ):
        asyncio.run(_scenario(script))


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_interleavings_end_every_request_exactly_once(
    script: list[tuple[Any, ...]],
) -> None:
    asyncio.run(_scenario(script))


def _short_tier_state() -> PrefillState:
    """:data:`ENGINES` (one rank each), all in the short tier."""
    ticks = itertools.count(1, 1)
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = PrefillState(PrefillSettings(), fleet, lambda: next(ticks))
    fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
    for e in ENGINES:
        fleet.register(e, PrefillEngineShape(dp_ranks=1), 0)
    state.last_demand_ns = [1, 0, 0, 0]
    state.rebalance(0, reason="join")
    assert state.engines_per_tier() == [3, 0, 0, 0]
    return state


def test_long_poll_woken_for_most_quota_and_passes_wake_on() -> None:
    async def scenario() -> None:
        state = _short_tier_state()
        quotas = {"e0": S, "e1": 3 * S, "e2": 2 * S}
        pulls = {
            e: asyncio.ensure_future(state.pull(e, 0, q, [], 3600 * S, 1))
            for e, q in quotas.items()
        }
        await asyncio.sleep(0)
        assert state.waiting_pulls(0) == 3
        subs = [asyncio.ensure_future(state.submit(f"r{i}", 1000, 0, 3600 * S)) for i in range(3)]
        done = await asyncio.gather(*subs)
        # Most quota first; each pull takes one (max_requests=1) and passes the wake on.
        assert [d.engine_id for d in done] == ["e1", "e2", "e0"]
        for task in pulls.values():
            assert len((await task).items) == 1

    asyncio.run(scenario())


def test_parked_pulls_are_offered_by_engine_id_whatever_order_they_parked_in() -> None:
    async def scenario() -> None:
        state = _short_tier_state()
        pulls = []
        for e in ("e2", "e0", "e1"):  # parked out of order, all alike: ties
            pulls.append(asyncio.ensure_future(state.pull(e, 0, S, [], 3600 * S, 1)))
            await asyncio.sleep(0)
        assert [w.engine.member_id for w in state.dispatcher.waiters] == ["e0", "e1", "e2"]
        subs = [asyncio.ensure_future(state.submit(f"r{i}", 1000, 0, 3600 * S)) for i in range(3)]
        done = await asyncio.gather(*subs)
        assert [d.engine_id for d in done] == ["e0", "e1", "e2"]  # ties: first by id
        for task in pulls:
            assert len((await task).items) == 1

    asyncio.run(scenario())


def test_orphan_tiers_do_not_thrash_when_engines_are_scarce() -> None:
    async def scenario() -> None:
        fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
        state = PrefillState(PrefillSettings(), fleet, lambda: 0)
        fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
        fleet.register("only", PrefillEngineShape(dp_ranks=1), 0)
        tasks = [
            asyncio.ensure_future(state.submit(f"r{i}", 1_000 if i % 2 else 30_000, 0, S))
            for i in range(20)
        ]
        await asyncio.sleep(0)
        # One engine, two tiers with demand: at most one move at once, none per submit.
        assert state.moves_total <= 1
        state.drain()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_rebalance_moves_the_emptiest_engine_to_the_short_tier() -> None:
    """An engine in the middle of a long prefill stays in the long tier; the one whose
    last pull showed no outstanding work is the one handed to the short tier."""

    async def scenario() -> None:
        fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
        state = PrefillState(PrefillSettings(hysteresis=0.0), fleet, lambda: 0)
        fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
        for e in ("e0", "e1"):
            fleet.register(e, PrefillEngineShape(dp_ranks=2), 0)
        state.last_demand_ns = [0, 0, 0, 1]
        state.rebalance(0, reason="join")
        assert state.engines_per_tier() == [0, 0, 0, 2]
        # e0 (lower id, which the id rule alone would keep) reports no work; e1 is busy.
        for e, loads in (("e0", [0, 0]), ("e1", [90 * S, 0])):
            batch = await state.pull(e, 0, 10 * S, loads, 0, 1)
            assert not batch.items
        state.last_demand_ns = [1, 0, 0, 1]
        state.rebalance(0, reason="join")
        assert state.engine_tier("e0") == 0
        assert state.engine_tier("e1") == 3
        state.drain()

    asyncio.run(scenario())
