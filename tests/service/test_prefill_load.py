"""Prefill balancer under load through the real daemon: the surge, and exactly-once
delivery with many engines pulling while submits and cancellations race."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import grpc
import numpy as np

from fulcrum.client import FulcrumClient
from tests.service.prefill_helpers import (
    prefill_daemon,
    pull_request,
    register,
    submit_request,
    until,
)

S = 1_000_000_000
K = 1024


async def _engine_loop(
    c: FulcrumClient,
    engine_id: str,
    inc: int,
    stop: asyncio.Event,
    got: dict[str, list[str]],
    *,
    busy_on_tier: int | None = None,
    rng: np.random.Generator | None = None,
) -> None:
    """Pull until ``stop``; record what arrives. An engine that receives work of
    ``busy_on_tier`` stays busy (stops pulling) until ``stop``."""
    while not stop.is_set():
        if rng is None:
            remaining, loads, max_req = 8 * S, [0, 0], 0
        else:
            remaining = int(rng.integers(1, 20)) * S // 2
            loads = [0, 0] if rng.random() < 0.5 else [int(rng.integers(0, S)), 0]
            max_req = int(rng.integers(0, 5))
        reply = await c.prefill.Pull(
            pull_request(engine_id, inc, remaining, loads, wait_ms=20, max_requests=max_req)
        )
        for r in reply.requests:
            got[r.request_id].append(engine_id)
        if busy_on_tier is not None and reply.requests and reply.tier == busy_on_tier:
            await stop.wait()


async def test_surge_moves_engines_and_short_waits_stay_bounded() -> None:
    async with prefill_daemon({"prefill": {"hysteresis": 1.0}}) as (_, c, st):
        engines = {f"e{i}": await register(c, f"e{i}", dp_ranks=2) for i in range(8)}
        stop = asyncio.Event()
        got: dict[str, list[str]] = defaultdict(list)
        loops = [
            asyncio.ensure_future(_engine_loop(c, e, inc, stop, got, busy_on_tier=3))
            for e, inc in engines.items()
        ]
        try:
            # Round 1: ordinary traffic in the two short tiers.
            before = [
                c.prefill.Submit(submit_request(f"s{i}", 2_000 + 100 * i)) for i in range(16)
            ] + [c.prefill.Submit(submit_request(f"m{i}", 30 * K)) for i in range(4)]
            for reply in await asyncio.gather(*before):
                assert reply.tier in (0, 1)
            split_before = st.rebalance(0, reason="round")
            assert split_before[3] == 0 and split_before[0] >= 1

            # The surge: 30 agent turns of 300K tokens each.
            surge = [
                asyncio.ensure_future(
                    c.prefill.Submit(submit_request(f"L{i}", 300 * K, wait_ms=55_000))
                )
                for i in range(30)
            ]
            await until(lambda: sum(st.queue_depths()) + len(got) >= 20 + 30)
            # Short traffic goes on in the same round.
            await asyncio.gather(
                *(c.prefill.Submit(submit_request(f"t{i}", 3_000)) for i in range(8))
            )
            # The next round, one dwell time later (prefill.min_tier_dwell_ms): engines the
            # first round moved may move again.
            split_after = st.rebalance(
                st.settings.min_tier_dwell_ms * 1_000_000, reason="round"
            )
            assert split_after[3] > split_before[3]
            assert split_after[3] >= 5  # most engines follow the quota demand
            assert split_after[0] >= 1  # the short tier keeps an engine
            await until(lambda: sum(1 for r in got if r.startswith("L")) == split_after[3])

            # Short requests during the surge are still served promptly, while the long
            # tier keeps a backlog its busy engines cannot touch.
            during = await asyncio.gather(
                *(c.prefill.Submit(submit_request(f"d{i}", 1_000 + i)) for i in range(20))
            )
            assert {r.tier for r in during} == {0}
            assert st.queue_depths()[3] >= 30 - 8
            surge_waits = st.queued_ns()[3]
            assert surge_waits > 0
            short_engines = {r.engine_id for r in during}
            assert all(st.engine_tier(e) == 0 for e in short_engines)
        finally:
            stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
            for task in surge:
                task.cancel()
            await asyncio.gather(*surge, return_exceptions=True)
        await until(lambda: st.queue_depths() == [0, 0, 0, 0])


async def test_exactly_once_under_concurrent_pulls_submits_cancels() -> None:
    rng = np.random.default_rng(20261130)
    async with prefill_daemon() as (_, c, st):
        outcomes: dict[str, list[tuple[str, str]]] = defaultdict(list)
        st.outcome_hooks.append(lambda rid, out, eng: outcomes[rid].append((out, eng)))
        engines = {f"e{i}": await register(c, f"e{i}", dp_ranks=2) for i in range(6)}
        stop = asyncio.Event()
        got: dict[str, list[str]] = defaultdict(list)
        loops = [
            asyncio.ensure_future(
                _engine_loop(c, e, inc, stop, got, rng=np.random.default_rng(i))
            )
            for i, (e, inc) in enumerate(engines.items())
        ]
        sizes = [1_000, 12 * K, 40 * K, 100 * K, 300 * K, 3_000_000]
        client_view: dict[str, str] = {}

        async def one(i: int) -> None:
            total = int(rng.choice(sizes)) + int(rng.integers(0, 500))
            cached = int(rng.integers(0, total))
            wait_ms = 30 if rng.random() < 0.2 else 10_000
            rid = f"r{i}"
            call = asyncio.ensure_future(
                c.prefill.Submit(submit_request(rid, total, cached, wait_ms=wait_ms))
            )
            draw = rng.random()
            if draw < 0.3:
                if draw < 0.2:  # cancel once the daemon holds it (queued or delivered)
                    await until(lambda: st.is_queued(rid) or rid in outcomes or call.done())
                for _ in range(int(rng.integers(0, 30))):
                    await asyncio.sleep(0)  # interleave with the pulls, then cancel
                call.cancel()
            try:
                reply = await call
                client_view[rid] = "ok:" + reply.engine_id
            except asyncio.CancelledError:
                client_view[rid] = "cancelled"
            except grpc.aio.AioRpcError as err:
                client_view[rid] = err.code().name

        async def rounds() -> None:
            while not stop.is_set():
                st.rebalance(0, reason="round")
                await asyncio.sleep(0.01)

        rounder = asyncio.ensure_future(rounds())
        try:
            for wave in range(8):
                await asyncio.gather(*(one(wave * 50 + i) for i in range(50)))
        finally:
            stop.set()
            await asyncio.gather(*loops, rounder, return_exceptions=True)

        n = 400
        assert len(client_view) == n
        # Server side: every request it saw ended exactly once; the others were cancelled
        # by their callers before they reached the daemon.
        assert set(outcomes) <= set(client_view)
        assert all(client_view[rid] == "cancelled" for rid in set(client_view) - set(outcomes))
        assert all(len(v) == 1 for v in outcomes.values()), "a request ended twice"
        # Engine side: delivered to at most one engine, once; exactly the delivered ones.
        assert all(len(v) == 1 for v in got.values()), "a request was delivered twice"
        delivered = {rid: out[0][1] for rid, out in outcomes.items() if out[0][0] == "delivered"}
        assert {rid: engs[0] for rid, engs in got.items()} == delivered
        # Client side agrees with the server.
        for rid, view in client_view.items():
            if rid not in outcomes:
                continue
            outcome, engine = outcomes[rid][0]
            if view.startswith("ok:"):
                assert (outcome, engine) == ("delivered", view[3:])
            elif view == "DEADLINE_EXCEEDED":
                assert outcome == "deadline_exceeded"
            else:
                # A cancel may race the server's own ending (delivery or expiry).
                assert view == "cancelled"
                assert outcome in ("cancelled", "delivered", "deadline_exceeded")
        kinds = Counter(o[0][0] for o in outcomes.values())
        assert kinds["delivered"] > 0 and kinds["cancelled"] > 0
        assert st.queue_depths() == [0, 0, 0, 0]
        assert all(st.waiting_pulls(t) == 0 for t in range(st.n_tiers))


async def test_drain_fails_queued_submits_and_ends_pulls() -> None:
    async with prefill_daemon() as (d, c, st):
        inc = await register(c, "e1")
        queued = asyncio.ensure_future(c.prefill.Submit(submit_request("q", 300 * K)))
        await until(lambda: st.queue_depths()[3] == 1)
        pull = asyncio.ensure_future(
            c.prefill.Pull(pull_request("e1", inc, 1, [S, 0, 0, 0], wait_ms=20_000))
        )
        await until(lambda: sum(st.waiting_pulls(t) for t in range(4)) == 1)
        d.app.start_draining()
        reply = await pull
        assert list(reply.requests) == []
        try:
            await queued
            raise AssertionError("queued submit should fail on drain")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert st.queue_depths() == [0, 0, 0, 0]
