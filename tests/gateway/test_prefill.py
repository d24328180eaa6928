"""P/D behind the gateway: the prefill engine and rank come from the prefill balancer,
with the daemon pulling on behalf of engines that do not run Fulcrum's engine loop."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from fulcrum.gateway.prefill import PrefillProxy
from fulcrum.gateway.testing import wait_for
from fulcrum.service.server import Daemon
from fulcrum.state.prefill import PrefillState
from fulcrum.testing import running_server
from tests.gateway.helpers import gateway_stack
from tests.gateway.test_extproc import Stream, body_msg, headers_msg, overrides, with_stub

PREFILL = [
    {"id": "p0", "host": "10.1.0.1", "ports": [7000]},
    {"id": "p1", "host": "10.1.0.2", "ports": [7000]},
]
PREFILL_ADDRS = {"10.1.0.1:7000", "10.1.0.2:7000"}


def pd_overrides(engines: list[dict[str, object]], **prefill: object) -> dict[str, object]:
    ov = overrides(prefill=prefill)
    ov["gateway"]["pool"]["prefill"] = engines  # type: ignore[index]
    return ov


def prompt(tokens: int) -> bytes:
    return json.dumps({"prompt": "q" * (4 * tokens), "max_tokens": 4}).encode()


def prefiller(resp: ep.ProcessingResponse) -> str:
    hs = {
        h.header.key: h.header.raw_value.decode()
        for h in resp.request_headers.response.header_mutation.set_headers
    }
    return hs.get("x-prefiller-host-port", "")


@pytest.fixture
async def pd() -> AsyncIterator[Daemon]:
    async with running_server(pd_overrides(PREFILL)) as d:
        yield d


def proxy(d: Daemon) -> PrefillProxy:
    p = d.gateway.picker.prefill
    assert p is not None
    return p


async def test_prefill_rank_chosen_by_the_balancer_and_accounted_until_first_token(
    pd: Daemon,
) -> None:
    state: PrefillState = pd.app.components["prefill"]
    px = proxy(pd)
    ch, stub = await with_stub(pd)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(prompt(1000), True))
        r = await s.recv()
        addr = prefiller(r)
        assert addr in PREFILL_ADDRS
        await s.recv()  # the body
        engine = "p0" if addr.startswith("10.1.0.1") else "p1"
        assert px.loads_ns(engine) == [state.predict_ns(1000, 0)]
        assert px.outstanding == 1
        await s.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
        await s.recv()
        assert px.loads_ns(engine) == [0]  # prefill done at the first response byte
        assert px.outstanding == 0
        await s.close()
        await wait_for(lambda: pd.gateway.picker.in_flight == 0, what="released")


async def test_a_loaded_prefill_engine_gets_less(pd: Daemon) -> None:
    """Engine choice by remaining quota: while one engine's prefill is outstanding, the
    next request goes to the other engine (once a round has given the short tier both
    engines: all the demand is there)."""
    px = proxy(pd)
    state: PrefillState = pd.app.components["prefill"]
    ch, stub = await with_stub(pd)
    async with ch:
        s1 = Stream(stub)
        await s1.send(headers_msg())
        await s1.send(body_msg(prompt(2000), True))
        first = prefiller(await s1.recv())
        await s1.recv()
        state.tick(pd.app.clock())  # the periodic round, now
        assert state.engines_per_tier()[0] == 2
        chosen = []
        for _ in range(3):
            s = Stream(stub)
            await s.send(headers_msg())
            await s.send(body_msg(prompt(100), True))
            chosen.append(prefiller(await s.recv()))
            await s.recv()
            await s.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
            await s.recv()
            await s.close()
        assert all(c in PREFILL_ADDRS - {first} for c in chosen), (first, chosen)
        await s1.close()
        await wait_for(lambda: px.outstanding == 0, what="finished at stream end")


async def test_no_engine_can_take_it_in_time_is_429_and_releases_decode() -> None:
    ov = pd_overrides([PREFILL[0]], wait_ms=300, queue_steps=1)
    async with running_server(ov) as d:
        state: PrefillState = d.app.components["prefill"]
        budget = state.settings.step_quota_ns  # one rank, one step
        n = next(t for t in range(1000, 200_000, 500) if state.predict_ns(t, 0) > budget // 2)
        ch, stub = await with_stub(d)
        async with ch:
            s1 = Stream(stub)
            await s1.send(headers_msg())
            await s1.send(body_msg(prompt(n), True))
            assert prefiller(await s1.recv()) == "10.1.0.1:7000"
            await s1.recv()
            decode_held = d.app.components["decode"].held
            s2 = Stream(stub)
            await s2.send(headers_msg())
            await s2.send(body_msg(prompt(n), True))
            r = (await s2.recv()).immediate_response
            assert r.status.code == 429
            assert b"prefill" in r.body
            assert d.app.components["decode"].held == decode_held  # decode part released
            await s1.close()


@pytest.mark.parametrize("unary", [False, True], ids=["ext_proc", "unary"])
async def test_envoy_passes_the_prefiller_header_to_the_decode_endpoint(unary: bool) -> None:
    # Unary mode: the prefiller header rides on the Check answer, and the prefill is
    # accounted finished at the release (no response message reaches the picker).
    async with gateway_stack(gateway={"pool": {"prefill": PREFILL}}, unary=unary) as st:
        r = await st.post("/v1/completions", {"prompt": "w" * 400, "max_tokens": 4})
        assert r.status == 200
        (got,) = [u.received[-1] for u in st.ups if u.received]
        assert got.headers["x-prefiller-host-port"] in PREFILL_ADDRS
        # A client cannot choose the prefiller either.
        spoof = {"x-prefiller-host-port": "6.6.6.6:1"}
        r = await st.post("/v1/completions", {"prompt": "w", "max_tokens": 4}, spoof)
        assert r.status == 200
        assert all(
            u.received[-1].headers.get("x-prefiller-host-port") != "6.6.6.6:1"
            for u in st.ups
            if u.received
        )
        px = st.gateway.picker.prefill
        assert px is not None
        await wait_for(lambda: px.outstanding == 0, what="prefill accounted as finished")


async def test_stream_gone_while_waiting_for_a_prefill_pull_releases_decode() -> None:
    ov = pd_overrides([PREFILL[0]], wait_ms=60_000, queue_steps=1)
    async with running_server(ov) as d:
        state: PrefillState = d.app.components["prefill"]
        budget = state.settings.step_quota_ns
        n = next(t for t in range(1000, 200_000, 500) if state.predict_ns(t, 0) > budget // 2)
        decode = d.app.components["decode"]
        ch, stub = await with_stub(d)
        async with ch:
            s1 = Stream(stub)
            await s1.send(headers_msg())
            await s1.send(body_msg(prompt(n), True))
            await s1.recv()
            await s1.recv()
            s2 = Stream(stub)
            await s2.send(headers_msg())
            await s2.send(body_msg(prompt(n), True))  # waits: the engine is full
            await wait_for(lambda: decode.held == 2, what="second decode placement")
            s2.call.cancel()
            await wait_for(lambda: decode.held == 1, what="released on cancel")
            assert d.gateway.picker.in_flight == 1
            await s1.close()
            await wait_for(lambda: d.gateway.picker.in_flight == 0, what="all released")


async def test_proxy_pulls_are_the_core_balancers_decisions(
    pd: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's pulls on behalf of gateway engines go through the one prefill
    balancer (``PrefillState.balancer``, the simulator's object): every batch a proxy
    engine receives is a ``take`` of that balancer, called with the proxy's accounting."""
    state: PrefillState = pd.app.components["prefill"]
    px = proxy(pd)
    takes: list[tuple[str, int, list[int], list[str]]] = []
    real_take = state.balancer.take

    def take(engine_id: str, remaining_ns: int, loads: list[int], **kw: object):  # type: ignore[no-untyped-def]
        taken = real_take(engine_id, remaining_ns, loads, **kw)  # type: ignore[arg-type]
        takes.append((engine_id, remaining_ns, list(loads), [q.request_id for q in taken.items]))
        return taken

    monkeypatch.setattr(state.balancer, "take", take)
    ch, stub = await with_stub(pd)
    async with ch:
        s = Stream(stub)
        await s.send(headers_msg())
        await s.send(body_msg(prompt(500), True))
        addr = prefiller(await s.recv())
        await s.recv()
        engine = "p0" if addr.startswith("10.1.0.1") else "p1"
        got = [t for t in takes if t[3]]
        assert len(got) == 1
        engine_id, remaining_ns, loads, _ids = got[0]
        assert engine_id == engine
        assert loads == [0]  # nothing outstanding before this one
        assert remaining_ns == px.remaining_ns(engine) + state.predict_ns(500, 0)
        await s.close()
        await wait_for(lambda: pd.gateway.picker.in_flight == 0, what="released")
