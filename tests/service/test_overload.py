"""Overload: every configured bound answers RESOURCE_EXHAUSTED with a retry hint (the
``retry-after-ms`` trailer) and changes nothing; under a burst of calls the daemon keeps
answering health checks and Ping. Short and bounded: tiny limits, no timing assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from fulcrum.client import FulcrumClient
from fulcrum.service.errors import RETRY_AFTER_KEY
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2, diagnostics_pb2, expert_pb2, fleet_pb2, prefill_pb2, vision_pb2
from tests.polling import FakeClock, until, until_async

Call = Callable[[FulcrumClient, int], Awaitable[Any]]


def _decode_member(i: int) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(
        member_id=f"decode-{i}",
        decode_instance=fleet_pb2.DecodeInstanceShape(
            gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=64, max_kv_tokens=1 << 24)] * 2
        ),
    )


async def _setup_none(c: FulcrumClient) -> None:
    return None


async def _setup_decode(c: FulcrumClient) -> None:
    await c.fleet.Register(_decode_member(0))


async def _setup_vision(c: FulcrumClient) -> None:
    await c.fleet.Register(
        fleet_pb2.RegisterRequest(
            member_id="ve-0",
            vision_machine=fleet_pb2.VisionMachineShape(gpus=2, max_patches_in_flight=1 << 30),
        )
    )


async def _register(c: FulcrumClient, i: int) -> Any:
    return await c.fleet.Register(
        fleet_pb2.RegisterRequest(
            member_id=f"engine-{i}", prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=1)
        )
    )


async def _place_decode(c: FulcrumClient, i: int) -> Any:
    return await c.decode.PlaceDecode(
        decode_pb2.PlaceDecodeRequest(request_id=f"r-{i}", kv_tokens=1000)
    )


async def _place_images(c: FulcrumClient, i: int) -> Any:
    return await c.vision.PlaceImages(
        vision_pb2.PlaceImagesRequest(
            request_id=f"r-{i}",
            images=[vision_pb2.Image(width=64, height=64, patch_size=16)],
        )
    )


async def _register_group(c: FulcrumClient, i: int) -> Any:
    return await c.expert.RegisterGroup(
        expert_pb2.RegisterGroupRequest(
            group_id=f"g-{i}", role=expert_pb2.GROUP_ROLE_DECODE, ep_size=4, num_layers=2,
            num_experts=8, expert_bytes=1024,
        )
    )


# name (the bound), overrides, setup, the call (i = a fresh id), the bound
CASES = [
    pytest.param("fleet.max_members", {"fleet": {"max_members": 3}}, _setup_none, _register,
                 3, id="fleet.max_members"),
    pytest.param("decode.max_placements", {"decode": {"max_placements": 3}}, _setup_decode,
                 _place_decode, 3, id="decode.max_placements"),
    pytest.param("vision.max_placements", {"vision": {"max_placements": 3}}, _setup_vision,
                 _place_images, 3, id="vision.max_placements"),
    pytest.param("eplb.max_groups", {"eplb": {"max_groups": 2}}, _setup_none, _register_group,
                 2, id="eplb.max_groups"),
]


@pytest.mark.parametrize(("name", "overrides", "setup", "call", "bound"), CASES)
async def test_bound_gives_resource_exhausted_with_retry_hint(
    name: str,
    overrides: dict[str, Any],
    setup: Callable[[FulcrumClient], Awaitable[None]],
    call: Call,
    bound: int,
) -> None:
    overrides = {**overrides, "metrics": {"enabled": False}}
    async with running_server(overrides) as d, FulcrumClient(d.address) as c:
        await setup(c)
        for i in range(bound):  # up to the bound every call is served (UNIMPLEMENTED fails)
            await call(c, i)
        for i in range(bound, bound + 2):  # refused again and again, state unchanged
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(c, i)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, name
            trailers = dict(err.value.trailing_metadata() or ())
            assert int(trailers.get(RETRY_AFTER_KEY, "0")) > 0, (name, trailers)
        # a refused call changed nothing: the earlier ones still stand
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await call(c, bound)
        assert again.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_prefill_queue_bound() -> None:
    """The per-tier queue bound refuses the next submit at once; queued ones still wait."""
    over = {"prefill": {"max_queued_per_tier": 2}, "metrics": {"enabled": False}}
    async with running_server(over) as d, FulcrumClient(
        d.address
    ) as c:
        # an engine must exist for submits to queue
        reply = await _register(c, 0)
        assert reply.incarnation
        waiting = [
            asyncio.ensure_future(
                c.prefill.Submit(
                    prefill_pb2.SubmitRequest(request_id=f"q-{i}", total_tokens=1000,
                                              max_wait_ms=30_000),
                    timeout=30,
                )
            )
            for i in range(2)
        ]
        try:
            assert d.app.components.get("prefill") is not None
            # wait (bounded) until both submits are queued
            await until_async(lambda: _queued_at_least(waiting, 2), "both submits queued")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.prefill.Submit(
                    prefill_pb2.SubmitRequest(request_id="q-over", total_tokens=1000)
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = dict(err.value.trailing_metadata() or ())
            assert int(trailers.get(RETRY_AFTER_KEY, "0")) > 0
            assert not any(t.done() for t in waiting)
        finally:
            for t in waiting:
                t.cancel()
            for t in waiting:
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await t


async def _queued_at_least(waiting: list[asyncio.Future[Any]], n: int) -> bool:
    """Whether at least ``n`` submits are queued, read from the metrics the balancer
    exports."""
    from fulcrum.metrics import REGISTRY

    for t in waiting:
        if t.done():
            t.result()  # surfaces an unexpected failure
    total = 0.0
    for family in REGISTRY.collect():
        if family.name == "fulcrum_prefill_queue_depth":
            total = sum(s.value for s in family.samples)
    return int(total) >= n


async def test_health_and_ping_answer_under_a_burst() -> None:
    """A burst of slow calls (each Ping sleeps 200 ms) past the stream limit of its
    connection (refused streams end UNAVAILABLE, which clients retry): health and a fresh
    Ping on another connection still answer while it is in flight, and every call of the
    burst ends OK, RESOURCE_EXHAUSTED, UNAVAILABLE or CANCELLED, never INTERNAL/UNKNOWN."""
    over = {"server": {"max_concurrent_streams": 256}, "metrics": {"enabled": False}}
    # the probe has its own connection (a local subchannel pool), as a kubelet would
    probe_opts = [("grpc.use_local_subchannel_pool", 1)]
    async with running_server(over) as d, FulcrumClient(d.address) as burst, FulcrumClient(
        d.address, options=probe_opts
    ) as probe:
        calls = [
            asyncio.ensure_future(
                burst.diagnostics.Ping(diagnostics_pb2.PingRequest(delay_ms=200), timeout=30)
            )
            for _ in range(640)
        ]
        # started: wait (bounded) until the daemon holds many calls in flight
        await until(lambda: d.app.in_flight >= 32, "32 calls in flight")
        health = await probe.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        pong = await probe.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"p"), timeout=10)
        assert pong.payload == b"p"
        results = await asyncio.gather(*calls, return_exceptions=True)
        codes = {
            r.code() if isinstance(r, grpc.aio.AioRpcError) else grpc.StatusCode.OK
            for r in results
        }
        # refused streams end UNAVAILABLE (or CANCELLED, gRPC's HTTP/2 layer decides)
        assert codes <= {
            grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
        }, codes
        # handlers finish just after their answers
        await until(lambda: d.app.in_flight == 0, "no call in flight")


# -- admission control --------------------------------------------------------------------


def _shed(cls: str, reason: str) -> float:
    from fulcrum.metrics import REGISTRY

    return REGISTRY.get_sample_value("fulcrum_rpc_shed_total",
                                     {"class": cls, "reason": reason}) or 0.0


async def test_class_concurrency_bound_answers_with_retry_hint() -> None:
    """Beyond server.admission.max_control concurrent control calls, the next one is
    answered RESOURCE_EXHAUSTED at once with retry-after-ms; health and placements, other
    classes, still answer; once the calls end the class admits again."""
    over = {"server": {"admission": {"max_control": 2, "retry_after_ms": 250}},
            "metrics": {"enabled": False}}
    async with running_server(over) as d, FulcrumClient(d.address) as c:
        await _setup_vision(c)
        admission = d.app.components["admission"]
        slow = [asyncio.ensure_future(
            c.diagnostics.Ping(diagnostics_pb2.PingRequest(delay_ms=60_000), timeout=90))
            for _ in range(2)]
        try:
            await until(lambda: admission.in_flight["control"] >= 2, "both slow calls in")
            before = _shed("control", "concurrency")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "control calls are being shed" in (err.value.details() or "")
            assert int(dict(err.value.trailing_metadata() or ())[RETRY_AFTER_KEY]) == 250
            assert _shed("control", "concurrency") == before + 1
            health = await c.health.Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            await _place_images(c, 1)  # the placement class is not full
        finally:
            for t in slow:
                t.cancel()
            for t in slow:
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await t
        await until(lambda: admission.in_flight["control"] == 0, "the slow calls ended")
        assert admission.in_flight == {"control": 0, "placement": 0, "admin": 0}
        await c.diagnostics.Ping(diagnostics_pb2.PingRequest())


async def test_late_loop_sheds_placements_but_not_control_calls() -> None:
    """While the event loop runs late, new placements are refused with a retry hint (at
    least twice the lateness) and change nothing; heartbeats, Pull-path calls, releases
    and health keep being served. A reload can turn shedding off."""
    from fulcrum.config import with_overrides
    from fulcrum.service.admission import class_of
    from fulcrum.service.looplag import LagMonitor

    async with running_server({"metrics": {"enabled": False}}) as d, FulcrumClient(
        d.address
    ) as c:
        await _setup_vision(c)
        reply = await c.fleet.Register(_decode_member(0))
        admission = d.app.components["admission"]
        # A probe of the daemon's kind, not running: its samples are the test's own (the
        # daemon's running probe would decay the lateness while the calls below run).
        assert isinstance(d.app.components["loop_lag"], LagMonitor)
        probe = LagMonitor()
        assert not admission.load_shedding
        admission.watch(probe)  # as fulcrum serve does with the daemon's probe
        assert admission.load_shedding
        probe.observe(1.0)  # the probe's sample after a 1 s stall reaches the admission
        assert admission.lag_s == 1.0
        before = _shed("placement", "loop_lag")
        for call in (_place_images, _place_decode):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(c, 7)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(err.value.trailing_metadata() or ())[RETRY_AFTER_KEY]) >= 1000
        assert _shed("placement", "loop_lag") == before + 2
        assert d.app.components["vision"] is not None
        await c.fleet.Heartbeat(fleet_pb2.HeartbeatRequest(
            member_id="decode-0", incarnation=reply.incarnation))
        await c.prefill.GetCostModel(prefill_pb2.GetCostModelRequest())
        await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        health = await c.health.Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert class_of("/fulcrum.v1.VisionBalancerService/ReleaseImages") == "control"
        assert class_of("/fulcrum.v1.PrefillBalancerService/Pull") == "control"
        assert class_of("/fulcrum.v1.PrefillBalancerService/Submit") == "placement"
        assert class_of("/fulcrum.v1.FleetService/ListMembers") == "admin"
        # reload: shedding off -> placements admitted although the loop is still "late"
        off = with_overrides(d.app.settings, {"server": {"admission": {"enabled": False}}})
        assert d.reload(off) == "applied"
        admission.observe_lag(1.0)
        await _place_images(c, 8)
        # the lateness halves every 10 ms of probe samples once the loop catches up
        on = with_overrides(d.app.settings, {"server": {"admission": {"enabled": True}}})
        assert d.reload(on) == "applied"
        for _ in range(8):
            admission.observe_lag(0.0)
        await _place_images(c, 9)


async def test_queued_calls_shed_placements_on_arrival_without_reading_them() -> None:
    """While a call has waited longer than server.admission.shed_wait_ms between its
    arrival and its handler, placements are refused on arrival (the request is not even
    parsed: a malformed one gets the same refusal), control calls go on; once the waiting
    call's handler starts (or it is forgotten), placements are admitted again."""
    import time

    from fulcrum.config.server import AdmissionSettings
    from fulcrum.service.admission import FORGET_AFTER, Admission

    # shed_wait_ms 10 s: the stuck call below (20 s old) counts as waiting for the next
    # 20 s whatever the machine's speed (it is forgotten after 4 x 10 s).
    over = {"metrics": {"enabled": False}, "server": {"admission": {"shed_wait_ms": 10_000}}}
    async with running_server(over) as d, FulcrumClient(d.address) as c:
        await _setup_vision(c)
        admission = d.app.components["admission"]
        admission.load_shedding = True  # as when the ticker runs (fulcrum serve)
        # a call that arrived 20 s ago and is still waiting for its handler
        stuck, _ = admission.arrive("control", time.perf_counter() - 20.0)
        before = _shed("placement", "queue_wait")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _place_images(c, 1)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(err.value.trailing_metadata() or ())[RETRY_AFTER_KEY]) >= 40_000
        raw = c.channel.unary_unary("/fulcrum.v1.VisionBalancerService/PlaceImages",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(b"\x0a\x02\xc3\x28")  # not parsed: refused as busy, not malformed
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _shed("placement", "queue_wait") == before + 2
        await c.diagnostics.Ping(diagnostics_pb2.PingRequest())  # control: served
        admission.started(stuck)
        await _place_images(c, 2)
        assert not admission.waiting  # every admitted call reached its handler
    # forgetting, with a synthetic clock
    a = Admission(AdmissionSettings(shed_wait_ms=100))
    a.load_shedding = True
    a.arrive("control", 10.0)
    assert a.arrive("placement", 10.05)[1] is None
    assert a.arrive("placement", 10.2)[1] is not None  # waited 200 ms > 100 ms
    assert a.arrive("control", 10.2)[1] is None  # control is never refused for it
    assert a.arrive("placement", 10.0 + FORGET_AFTER * 0.1 + 0.01)[1] is not None  # 10.05
    assert a.arrive("placement", 10.2 + FORGET_AFTER * 0.1 + 0.01)[1] is None  # forgotten


async def test_refused_and_malformed_calls_stop_waiting() -> None:
    """A call the input guard refuses (malformed bytes) or that fails in its handler is
    no longer counted as waiting: it cannot make the daemon shed placements."""
    async with running_server({"metrics": {"enabled": False}}) as d, FulcrumClient(
        d.address
    ) as c:
        admission = d.app.components["admission"]
        raw = c.channel.unary_unary("/fulcrum.v1.FleetService/Register",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(b"\x0a\x02\xc3\x28")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError):
            await c.fleet.Heartbeat(fleet_pb2.HeartbeatRequest(member_id="nobody"))
        assert not admission.waiting
        # The client has its answer as soon as the status is sent; the server's handler
        # task finishes (and leaves in_flight) a moment later: wait for it, bounded.
        await until(lambda: admission.in_flight == {"control": 0, "placement": 0, "admin": 0},
                    "every handler task finished")


async def test_calls_abandoned_before_their_handler_stop_waiting() -> None:
    """A call whose caller gives up before its handler runs (gRPC cancels the call's task
    while it waits for the message) is no longer counted as waiting: it cannot make the
    daemon shed placements. (Through the shell interceptor, with the task cancelled at the
    point where gRPC would be receiving the request.)"""
    from types import SimpleNamespace

    from fulcrum.config.server import AdmissionSettings
    from fulcrum.service.admission import Admission
    from fulcrum.service.app import App
    from fulcrum.service.interceptors import ShellInterceptor
    from fulcrum.testing import test_settings

    admission = Admission(AdmissionSettings())
    shell = ShellInterceptor(App.create(test_settings()), admission)

    async def continuation(details: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    details = SimpleNamespace(method="/fulcrum.v1.VisionBalancerService/PlaceImages",
                              invocation_metadata=())
    parked = asyncio.Event()

    async def rpc() -> None:
        await shell.intercept_service(continuation, details)
        parked.set()
        await asyncio.Event().wait()  # receiving the request message, forever

    task = asyncio.ensure_future(rpc())
    await parked.wait()
    assert len(admission.waiting) == 1
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert not admission.waiting


def test_calls_abandoned_in_the_queue_shed_placements() -> None:
    """When callers give up on more than 10% of the calls before their handlers run (the
    signature of a queue inside gRPC in front of the handlers), placements are refused on
    arrival, with a retry hint, for the next window; control calls are not. (A fake clock
    decides the 100 ms windows.)"""
    from fulcrum.config.server import AdmissionSettings
    from fulcrum.service.admission import ABANDONED_SHARE, WINDOW_S, Admission

    clock = FakeClock()
    a = Admission(AdmissionSettings(), clock=clock)
    a.load_shedding = True
    tokens = [a.arrive("control", clock())[0] for _ in range(40)]
    for t in tokens[:32]:
        a.started(t)
    for t in tokens[32:]:
        a.ended(t)  # 8 of 40 abandoned, all inside one window
    for t in tokens:
        a.ended(t)  # a task that ends after its handler started is not abandoned
    assert a.abandoned_share == 0.0  # the window is still open
    clock.advance(WINDOW_S)  # the window closes
    b, _ = a.arrive("control", clock())
    a.started(b)  # closes the window: 20% abandoned
    assert a.abandoned_share == 0.2 > ABANDONED_SHARE
    token, hint = a.arrive("placement", clock())
    assert token == 0 and hint is not None and hint >= 100
    assert a.arrive("control", clock())[1] is None
    # ... for the next window only: two windows on, placements are admitted again
    clock.advance(2 * WINDOW_S)
    assert a.arrive("placement", clock())[1] is None
    # a few cancels among few calls are not a queue
    few = Admission(AdmissionSettings(), clock=clock)
    few.load_shedding = True
    toks = [few.arrive("control", clock())[0] for _ in range(4)]
    few.ended(toks[0])
    few.ended(toks[1])
    clock.advance(WINDOW_S)  # the window closes
    c, _ = few.arrive("control", clock())
    few.started(c)
    assert few.abandoned_share == 0.0
    assert few.arrive("placement", clock())[1] is None


def test_abandoned_calls_spread_over_windows_are_not_a_queue() -> None:
    """8 abandoned calls among 40 spread over two windows (4 per window, under the
    minimum of 8): no shedding."""
    from fulcrum.config.server import AdmissionSettings
    from fulcrum.service.admission import WINDOW_S, Admission

    clock = FakeClock()
    a = Admission(AdmissionSettings(), clock=clock)
    a.load_shedding = True
    for _ in range(2):
        tokens = [a.arrive("control", clock())[0] for _ in range(20)]
        for t in tokens[:16]:
            a.started(t)
        for t in tokens[16:]:
            a.ended(t)
        clock.advance(WINDOW_S)
    b, _ = a.arrive("control", clock())
    a.started(b)
    assert a.abandoned_share == 0.0
    assert a.arrive("placement", clock())[1] is None


@pytest.mark.parametrize(("probe_ms", "samples_per_half"), [(10, 1), (50, 0.2), (5, 2)])
def test_loop_lateness_halves_every_10_ms_whatever_the_probe_period(
    probe_ms: int, samples_per_half: float
) -> None:
    """The smoothed lateness the admission sheds on halves every 10 ms of probe samples
    once the loop catches up, at any ``server.loop_lag_probe_ms`` (a longer period must
    not keep an old stall refusing placements for longer)."""
    from fulcrum.config.server import AdmissionSettings
    from fulcrum.service.admission import Admission
    from fulcrum.service.looplag import LagMonitor

    a = Admission(AdmissionSettings())
    probe = LagMonitor(probe_ms / 1000)
    a.watch(probe)
    probe.observe(1.0)
    assert a.lag_s == 1.0
    probe.observe(0.0)
    assert a.lag_s == pytest.approx(0.5 ** (1 / samples_per_half))
    probe.observe(0.8)  # a new late sample above the decayed value wins
    assert a.lag_s == 0.8


async def test_loop_lag_probe_period_is_the_setting() -> None:
    """``server.loop_lag_probe_ms`` sets the daemon's probe period (default 50 ms)."""
    from fulcrum.config import Settings
    from fulcrum.service.looplag import INTERVAL_S

    assert Settings().server.loop_lag_probe_ms == INTERVAL_S * 1000 == 50
    async with running_server({"server": {"loop_lag_probe_ms": 20}}) as d:
        assert d.app.components["loop_lag"].interval_s == 0.02
